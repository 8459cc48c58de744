"""DeepSeek-V4's per-slot state as PER-TOKEN ROWS, so a store keyed by token prefix (LMCache: a
hash chain over chunks of tokens) can hold it: row ``t`` depends only on tokens ``[0, t]``.

Row ``t`` holds, per layer (columns in :class:`StateRowLayout`):
- ``window``: token t's rotated K(=V) for the sliding window  [head_dim]
- compressed layers: the compressor's raw ``kv`` and ``gate`` projections of token t [width]
  each, and the compressed entry whose window CLOSES at t (``(t + 1) % rate == 0``; zeros
  otherwise) [head_dim]; CSA layers the same again for the indexer at ``index_head_dim``.
The state after any ``m`` tokens is rebuilt exactly from rows ``[0, m)``: the ring = the window
rows of the last ``sliding_window`` tokens; entries = the closed ones; the carry-over = the raw
rows of the open window; the CSA overlap = the Ca half of the raw rows of the last closed window
(its gate plus the compressor's fp32 ``position_bias``, the same add the compressor does).

The slot itself does not keep old tokens' window KV or raw projections, so a slot that will be
exported records its rows to host memory while it is computed (``start_recording``; the hook in
``LayerCache.recorders``). Host memory only: nothing here allocates on the device or grows the
fixed extent; ``import_rows`` copies into the slot's existing tensors.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import InvalidRequest
from engine.models.deepseek_v4.cache_state import CompressorState, DeepseekV4CacheState
from engine.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config

ROWS_VERSION = "rows-v1"


@dataclass(frozen=True)
class CompressorColumns:
    kv: slice
    gate: slice
    entry: slice


@dataclass(frozen=True)
class LayerColumns:
    window: slice
    compressor: CompressorColumns | None
    indexer: CompressorColumns | None


@dataclass(frozen=True)
class StateRowLayout:
    """Where each piece of one token's state lives in its row (``row_width`` is even, so a row
    splits into LMCache's K/V halves)."""

    layers: tuple[LayerColumns, ...]
    row_width: int

    @classmethod
    def from_config(cls, cfg: DeepseekV4Config) -> StateRowLayout:
        off = 0

        def take(n: int) -> slice:
            nonlocal off
            off += n
            return slice(off - n, off)

        def comp(dim: int, overlap: bool) -> CompressorColumns:
            width = 2 * dim if overlap else dim
            return CompressorColumns(take(width), take(width), take(dim))

        layers = []
        for lt in cfg.layer_types:
            window = take(cfg.head_dim)
            main = None if lt == SLIDING else comp(cfg.head_dim, lt == CSA)
            index = comp(cfg.index_head_dim, True) if lt == CSA else None
            layers.append(LayerColumns(window, main, index))
        return cls(tuple(layers), off + off % 2)


class DeepseekV4StateRows:
    """Export / import of one cache slot as per-token rows (see the module docstring).

    ``position_biases[layer] = (compressor bias, indexer bias)``: the fp32 ``[rate, width]``
    parameters the overlap gate is rebuilt with (None where the layer has no such compressor).
    """

    def __init__(self, cache: DeepseekV4CacheState,
                 position_biases: list[tuple[torch.Tensor | None, torch.Tensor | None]]) -> None:
        assert len(position_biases) == len(cache.layers)
        self.cache = cache
        self.layout = StateRowLayout.from_config(cache.cfg)
        self.position_biases = position_biases
        self._buffers: dict[int, torch.Tensor] = {}

    @classmethod
    def for_model(cls, cache: DeepseekV4CacheState, model: Any) -> DeepseekV4StateRows:
        """``model``: the DeepseekV4Model whose compressors fill ``cache``."""
        biases: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        for layer in model.model.layers:
            comp = layer.self_attn.compressor
            idx = getattr(comp, "indexer", None)
            biases.append((None if comp is None else comp.position_bias.detach(),
                           None if idx is None else idx.position_bias.detach()))
        return cls(cache, biases)

    @property
    def row_width(self) -> int:
        return self.layout.row_width

    @property
    def dtype(self) -> torch.dtype:
        return self.cache.dtype

    @property
    def fingerprint(self) -> str:
        """The cache state's layout fingerprint plus this row encoding's."""
        desc = f"{self.cache.fingerprint};{ROWS_VERSION};w={self.row_width}"
        return desc + ";r=" + hashlib.sha256(desc.encode()).hexdigest()[:12]

    # --- recording (export side) --------------------------------------------------------------
    def start_recording(self, slot: int, num_tokens: int) -> None:
        """From now on, rows of tokens ``[0, num_tokens)`` that ``slot`` computes are copied to a
        host buffer (later tokens are not recorded)."""
        if not 0 <= slot < self.cache.max_batch:
            raise InvalidRequest(f"cache slot {slot} outside [0, {self.cache.max_batch})",
                                 field="cache_slot")
        buf = torch.zeros(num_tokens, self.row_width, dtype=self.dtype)  # host
        self._buffers[slot] = buf
        for lc, cols in zip(self.cache.layers, self.layout.layers, strict=True):
            lc.recorders[slot] = _recorder(buf, cols)

    def stop_recording(self, slot: int) -> None:
        self._buffers.pop(slot, None)
        for lc in self.cache.layers:
            lc.recorders.pop(slot, None)

    def is_recording(self, slot: int) -> bool:
        return slot in self._buffers

    def export_rows(self, slot: int, num_tokens: int | None = None) -> torch.Tensor:
        """Rows ``[0, n)`` of a recording slot (n = what it holds by default): a host tensor
        ``[n, row_width]`` (a view of the recording buffer: valid until ``stop_recording``)."""
        buf = self._buffers.get(slot)
        if buf is None:
            raise InvalidRequest(f"deepseek_v4 slot {slot} was not recorded for export",
                                 field="cache_slot")
        held = self.cache.num_tokens[slot]
        n = held if num_tokens is None else num_tokens
        if not 0 <= n <= min(held, buf.shape[0]):
            raise InvalidRequest(
                f"cannot export {n} tokens of slot {slot}: it holds {held}, "
                f"{buf.shape[0]} were recorded", field="num_tokens")
        for lc, cols in zip(self.cache.layers, self.layout.layers, strict=True):
            for st, cc in ((lc.compressor, cols.compressor), (lc.indexer, cols.indexer)):
                if st is not None and cc is not None:
                    e = n // st.rate
                    buf[st.rate - 1 : e * st.rate : st.rate, cc.entry] = st.entries[slot, :e].cpu()
        return buf[:n]

    # --- import --------------------------------------------------------------------------------
    def import_rows(self, slot: int, rows: torch.Tensor, num_tokens: int) -> int:
        """Rebuild ``slot``'s exact state after ``num_tokens`` tokens from ``rows[:num_tokens]``
        (rows: [>= num_tokens, row_width], any device). Returns ``num_tokens``."""
        m = num_tokens
        if rows.dim() != 2 or rows.shape[1] != self.row_width or rows.dtype != self.dtype:
            raise InvalidRequest(
                f"deepseek_v4 state rows {tuple(rows.shape)} {rows.dtype}: expected "
                f"[n, {self.row_width}] {self.dtype}", field="kv_state")
        if not 0 <= m <= min(rows.shape[0], self.cache.max_context):
            raise InvalidRequest(
                f"cannot import {m} tokens from {rows.shape[0]} rows (max_context="
                f"{self.cache.max_context})", field="kv_state")
        win = self.cache.cfg.sliding_window
        for lc, cols, biases in zip(self.cache.layers, self.layout.layers, self.position_biases,
                                    strict=True):
            # the ring holds position p at p % win: at most two contiguous runs
            p = max(0, m - win)
            while p < m:
                run = min(m, p + win - p % win)
                lc.window[slot, p % win : p % win + run - p].copy_(rows[p:run, cols.window])
                p = run
            for st, cc, bias in ((lc.compressor, cols.compressor, biases[0]),
                                 (lc.indexer, cols.indexer, biases[1])):
                if st is not None and cc is not None:
                    _import_compressor(st, cc, bias, slot, rows, m)
        self.cache.num_tokens[slot] = m
        buf = self._buffers.get(slot)
        if buf is not None:  # an exporting slot that loaded its prefix keeps those rows too
            k = min(m, buf.shape[0])
            buf[:k] = rows[:k].cpu()
        return m


def _import_compressor(st: CompressorState, cc: CompressorColumns, bias: torch.Tensor | None,
                       slot: int, rows: torch.Tensor, m: int) -> None:
    # copy_ straight into the slot's tensors: no device temporaries (nothing for the caching
    # allocator to grow after warm-up)
    r = st.rate
    e, o = m // r, m % r
    if e:
        st.entries[slot, :e].copy_(rows[r - 1 : e * r : r, cc.entry])
    if o:
        st.buf_kv[slot, :o].copy_(rows[e * r : m, cc.kv])
        st.buf_gate[slot, :o].copy_(rows[e * r : m, cc.gate])
    if st.ov_kv is not None and st.ov_gate is not None and e:
        assert bias is not None
        d = st.ov_kv.shape[-1]
        last = rows[(e - 1) * r : e * r]
        st.ov_kv[slot].copy_(last[:, cc.kv][:, :d])
        # the compressor computes (model-dtype gate + fp32 bias) in fp32: widening is exact and
        # the add rounds once, so widen-then-add-in-place is bit-identical
        st.ov_gate[slot].copy_(last[:, cc.gate][:, :d])
        st.ov_gate[slot].add_(bias[:, :d])


def _recorder(buf: torch.Tensor, cols: LayerColumns):  # noqa: ANN202 - a LayerCache hook
    def record(start: int, t: Any) -> None:
        n = min(t.kv.shape[0], buf.shape[0] - start)
        if n <= 0:
            return
        dst = buf[start : start + n]
        dst[:, cols.window] = t.kv[:n]
        if cols.compressor is not None:
            dst[:, cols.compressor.kv] = t.kv_c[:n]
            dst[:, cols.compressor.gate] = t.gate_c[:n]
        if cols.indexer is not None:
            dst[:, cols.indexer.kv] = t.kv_i[:n]
            dst[:, cols.indexer.gate] = t.gate_i[:n]

    return record
