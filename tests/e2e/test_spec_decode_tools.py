"""Tool calls and structured outputs with the decode worker verifying n-gram drafts
(``bulkhead up --speculative-method ngram``): the tests of test_tools_and_structured.py, run
again against a deployment with speculation on, on the same tiny tool model. In the three-turn
agent loop the earlier calls are in the prompt, so drafts copy them: every answer must still
be a declared call with arguments that validate against its schema, because each draft's row
is masked by the grammar and drafts the grammar refuses are cut."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import E2E, deploy
from tests.e2e.test_tools_and_structured import (  # noqa: F401 - collected here again
    test_json_object_response,
    test_json_schema_response,
    test_named_function_and_one_call,
    test_required_gives_declared_tool_calls,
    test_streamed_deltas_reassemble_the_non_streamed_calls,
    test_three_turn_agent_loop_reuses_the_prefix,
)
from tests.helpers.tiny_tool_model import write_tiny_tool_llama


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    yield from deploy(tmp_path_factory, "--max-context", "4096", "--chunk-tokens", "256",
                      write_model=write_tiny_tool_llama, speculative_method="ngram",
                      num_speculative_tokens=4)


def test_zz_drafts_were_verified(e2e: E2E) -> None:
    """Runs after the tests above (pytest keeps file order): they verified drafts."""
    time.sleep(1.5)  # the router's poll of GetInfo brings the counters
    assert e2e.metric("vllm:spec_decode_num_draft_tokens_total") > 0
