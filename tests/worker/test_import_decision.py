"""decode_worker/import_decision.py: when a decode worker fetches a prompt's KV."""

from __future__ import annotations

import pytest

from decode_worker.import_decision import decide_import

OURS = "layout-a"


@pytest.mark.parametrize("num_prompt, has_prefill, layout, stored, fetch", [
    (7, False, "", 0, True),          # a short prompt: load any prefix the store holds
    (7, True, OURS, 5, True),         # a handoff in our layout
    (7, True, "", 5, True),           # a peer that sent no layout: nothing to compare
    (7, True, "layout-b", 5, False),  # another layout: its bytes would be garbage here
    (7, True, OURS, 0, False),        # the prefill stored nothing: a fetch could only miss
    (0, False, "", 0, False),         # nothing to fetch
])
def test_decide_import(num_prompt: int, has_prefill: bool, layout: str, stored: int,
                       fetch: bool) -> None:
    decision = decide_import(num_prompt, has_prefill, layout, stored, OURS)
    assert decision.fetch is fetch
    assert (decision.reason == "") is fetch


def test_layout_mismatch_names_both_layouts() -> None:
    reason = decide_import(3, True, "layout-b", 3, OURS).reason
    assert "layout-b" in reason and OURS in reason
