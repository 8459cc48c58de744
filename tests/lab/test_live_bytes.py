"""LiveBytes counts the storages a region creates, once per storage, until they are freed."""

from __future__ import annotations

import torch

from lab.bench.live_bytes import LiveBytes


def test_counts_new_storages_once_and_releases_them() -> None:
    before = torch.ones(1000)  # made outside the region: never counted, nor are its views
    with torch.inference_mode(), LiveBytes() as t:
        y = before + 1  # a fresh result: 4000 B
        view = y[3:]
        del y  # the view keeps the storage alive
        assert t.live == 4000
        z = torch.empty(500)
        z.add_(1)  # in place: nothing new
        torch.add(before, 1, out=torch.empty(1000))  # out=: only the empty() is new
        assert t.live == 6000
        before[10:20].clone()  # a view of an old storage copied: 40 B, dropped at once
        del view
        assert t.live == 2000
        values, ids = torch.topk(before, 7)  # two outputs, two storages
        assert t.live == 2000 + 7 * 4 + 7 * 8
        del values, ids, z
    assert t.live == 0
    assert t.peak == 10_000  # y, the out= buffer and z together
    assert [a.nbytes for a in t.at_peak] == [4000, 4000, 2000]
    assert "test_live_bytes.py" in t.at_peak[0].where
