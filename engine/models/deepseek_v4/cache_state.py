"""DeepSeek-V4's per-sequence cache state, allocated once for (max_batch slots, max_context).

Per layer and slot: the sliding-window K(=V) ring, and for compressed layers the compressed
entries, the compressor's carry-over of a not-yet-closed window (raw projections of up to
``rate - 1`` tokens) and, for CSA, the overlap state (Ca slice of the last closed window) -- the
same again at ``index_head_dim`` for the lightning indexer's keys. Every tensor is sized for the
worst case at construction and never grows; a slot is addressed by its index in ``[0, max_batch)``.

Must never allocate after construction (export/import copy into/out of the fixed tensors).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.errors import InvalidRequest
from engine.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config


@dataclass
class CompressorState:
    """One compressor's state for all slots of one layer."""

    rate: int
    entries: torch.Tensor  # [max_batch, max_context // rate, dim] model dtype (after norm + rope)
    buf_kv: torch.Tensor  # [max_batch, rate, width] raw kv projections of the open window
    buf_gate: torch.Tensor  # [max_batch, rate, width] raw gate projections of the open window
    ov_kv: torch.Tensor | None  # CSA: [max_batch, rate, dim] Ca slice of the last closed window
    ov_gate: torch.Tensor | None  # CSA: [max_batch, rate, dim] fp32, its gate + position bias

    def named(self, prefix: str) -> list[tuple[str, torch.Tensor]]:
        out = [(f"{prefix}.entries", self.entries), (f"{prefix}.buf_kv", self.buf_kv),
               (f"{prefix}.buf_gate", self.buf_gate)]
        if self.ov_kv is not None and self.ov_gate is not None:
            out += [(f"{prefix}.ov_kv", self.ov_kv), (f"{prefix}.ov_gate", self.ov_gate)]
        return out


@dataclass
class LayerCache:
    window: torch.Tensor  # [max_batch, sliding_window, head_dim]; position p lives at p % W
    compressor: CompressorState | None
    indexer: CompressorState | None
    # slot -> hook(start_pos, step rows of that sequence): copies the per-token rows of a slot
    # being exported (engine/models/deepseek_v4/state_rows.py) to host memory as they are made
    recorders: dict[int, Callable[[int, Any], None]] = field(default_factory=dict)


@dataclass(frozen=True)
class SlotExport:
    """One slot's state as flat tensors, for a KV store (LMCache) between two engines."""

    fingerprint: str
    num_tokens: int
    tensors: tuple[tuple[str, torch.Tensor], ...]  # fixed order; compressed entries trimmed


def _compressor_state(
    max_batch: int, max_context: int, rate: int, dim: int, overlap: bool,
    dtype: torch.dtype, device: torch.device,
) -> CompressorState:
    width = 2 * dim if overlap else dim
    return CompressorState(
        rate=rate,
        entries=torch.zeros(max_batch, max_context // rate, dim, dtype=dtype, device=device),
        buf_kv=torch.zeros(max_batch, rate, width, dtype=dtype, device=device),
        buf_gate=torch.zeros(max_batch, rate, width, dtype=dtype, device=device),
        ov_kv=torch.zeros(max_batch, rate, dim, dtype=dtype, device=device) if overlap else None,
        ov_gate=(
            torch.zeros(max_batch, rate, dim, dtype=torch.float32, device=device) if overlap else None
        ),
    )


class DeepseekV4CacheState:
    """The fixed extent of V4's attention state. ``num_tokens[slot]`` counts the tokens a slot
    has absorbed; entries, carry-over and ring phase all follow from it."""

    def __init__(
        self, cfg: DeepseekV4Config, max_batch: int, max_context: int,
        dtype: torch.dtype, device: torch.device | str,
    ) -> None:
        if max_batch < 1 or max_context < 1:
            raise InvalidRequest(f"max_batch={max_batch} and max_context={max_context} must be >= 1")
        self.cfg = cfg
        self.max_batch = max_batch
        self.max_context = max_context
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_tokens = [0] * max_batch
        self.layers: list[LayerCache] = []
        for lt in cfg.layer_types:
            window = torch.zeros(max_batch, cfg.sliding_window, cfg.head_dim, dtype=dtype, device=self.device)
            comp = idx = None
            if lt != SLIDING:
                rate = cfg.rate(lt)
                comp = _compressor_state(max_batch, max_context, rate, cfg.head_dim, lt == CSA, dtype, self.device)
                if lt == CSA:
                    idx = _compressor_state(max_batch, max_context, rate, cfg.index_head_dim, True, dtype, self.device)
            self.layers.append(LayerCache(window, comp, idx))

    # --- bookkeeping -------------------------------------------------------------------------
    def reset_slot(self, slot: int) -> None:
        """Forget a slot's sequence (no tensor work: stale data is never read past num_tokens)."""
        self.num_tokens[slot] = 0

    def pretend_filled(self, slot: int, num_tokens: int) -> None:
        """Warm-up only: mark ``slot`` as holding ``num_tokens`` tokens (whatever its tensors
        contain), so a warm-up step runs against the longest context and its measured peak is
        the worst case. Reset the slot afterwards."""
        if not 0 <= num_tokens <= self.max_context:
            raise InvalidRequest(f"num_tokens={num_tokens} outside [0, {self.max_context}]", field="num_tokens")
        self.num_tokens[slot] = num_tokens

    def check_room(self, slot: int, num_new: int) -> None:
        if self.num_tokens[slot] + num_new > self.max_context:
            raise InvalidRequest(
                f"deepseek_v4 cache slot {slot}: {self.num_tokens[slot]} + {num_new} tokens exceeds "
                f"max_context={self.max_context} of the fixed extent", field="max_context",
            )

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        for i, layer in enumerate(self.layers):
            out.append((f"{i}.window", layer.window))
            if layer.compressor is not None:
                out += layer.compressor.named(f"{i}.compressor")
            if layer.indexer is not None:
                out += layer.indexer.named(f"{i}.indexer")
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named_tensors())

    @property
    def fingerprint(self) -> str:
        """Identifies the export layout; both sides of a transfer must agree on it."""
        c = self.cfg
        desc = (
            f"deepseek_v4/state-v1;dtype={str(self.dtype).removeprefix('torch.')};"
            f"hd={c.head_dim};ihd={c.index_head_dim};win={c.sliding_window};"
            f"csa={c.csa_rate};hca={c.hca_rate};layers={','.join(t[0] for t in c.layer_types)};"
            f"rope={c.rope_head_dim}"
        )
        return desc + ";h=" + hashlib.sha256(desc.encode()).hexdigest()[:12]

    # --- export / import ---------------------------------------------------------------------
    def _slot_views(self, slot: int, n: int) -> list[tuple[str, torch.Tensor]]:
        views: list[tuple[str, torch.Tensor]] = []
        for name, t in self.named_tensors():
            v = t[slot]
            if name.endswith(".entries"):
                v = v[: n // self._rate_of(name)]
            views.append((name, v))
        return views

    def _rate_of(self, name: str) -> int:
        layer = int(name.split(".")[0])
        return self.cfg.rate(self.cfg.layer_types[layer])

    def export_slot(self, slot: int) -> SlotExport:
        """Copies of one slot's state (compressed entries trimmed to those emitted)."""
        n = self.num_tokens[slot]
        tensors = tuple((name, v.clone()) for name, v in self._slot_views(slot, n))
        return SlotExport(self.fingerprint, n, tensors)

    def import_slot(self, slot: int, state: SlotExport) -> None:
        """Load an exported state into ``slot``; checks the fingerprint and every shape."""
        if state.fingerprint != self.fingerprint:
            raise InvalidRequest(
                f"deepseek_v4 state layout mismatch: got {state.fingerprint!r}, this engine has "
                f"{self.fingerprint!r}", field="kv_state",
            )
        if state.num_tokens > self.max_context:
            raise InvalidRequest(
                f"imported state holds {state.num_tokens} tokens > max_context={self.max_context}",
                field="kv_state",
            )
        views = self._slot_views(slot, state.num_tokens)
        if [n for n, _ in views] != [n for n, _ in state.tensors]:
            raise InvalidRequest("deepseek_v4 imported state has different tensor names", field="kv_state")
        for (name, dst), (_, src) in zip(views, state.tensors, strict=True):
            if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
                raise InvalidRequest(
                    f"deepseek_v4 imported tensor {name}: {tuple(src.shape)} {src.dtype}, expected "
                    f"{tuple(dst.shape)} {dst.dtype}", field="kv_state",
                )
            dst.copy_(src)
        self.num_tokens[slot] = state.num_tokens

    def pack(self, state: SlotExport) -> torch.Tensor:
        """A SlotExport as one flat uint8 tensor (on the tensors' device), in its fixed order."""
        return torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in state.tensors])

    def unpack(self, flat: torch.Tensor, fingerprint: str, num_tokens: int) -> SlotExport:
        """Inverse of :meth:`pack` for this engine's layout and ``num_tokens``."""
        tensors = []
        offset = 0
        for name, ref in self._slot_views(0, num_tokens):
            nbytes = ref.numel() * ref.element_size()
            if offset + nbytes > flat.numel():
                raise InvalidRequest(f"packed deepseek_v4 state too short at {name}", field="kv_state")
            t = flat[offset : offset + nbytes].view(ref.dtype).view(ref.shape)
            tensors.append((name, t))
            offset += nbytes
        if offset != flat.numel():
            raise InvalidRequest(
                f"packed deepseek_v4 state has {flat.numel() - offset} trailing bytes", field="kv_state"
            )
        return SlotExport(fingerprint, num_tokens, tuple(tensors))


def deepseek_v4_cache_bytes(
    cfg: DeepseekV4Config | Any, max_batch: int, max_context: int, dtype: torch.dtype = torch.bfloat16
) -> dict[str, int]:
    """Bytes of :class:`DeepseekV4CacheState` by role, without allocating it (``cfg``: a
    DeepseekV4Config or the engine's ModelConfig)."""
    cfg = DeepseekV4Config.coerce(cfg)
    e = torch.empty((), dtype=dtype).element_size()
    out = {"sliding_window_kv": 0, "compressed_kv": 0, "indexer_keys": 0, "compressor_carry": 0}
    for lt in cfg.layer_types:
        out["sliding_window_kv"] += max_batch * cfg.sliding_window * cfg.head_dim * e
        if lt == SLIDING:
            continue
        rate = cfg.rate(lt)
        out["compressed_kv"] += max_batch * (max_context // rate) * cfg.head_dim * e
        dims = [(cfg.head_dim, lt == CSA)]
        if lt == CSA:
            out["indexer_keys"] += max_batch * (max_context // rate) * cfg.index_head_dim * e
            dims.append((cfg.index_head_dim, True))
        for dim, overlap in dims:
            width = 2 * dim if overlap else dim
            carry = 2 * max_batch * rate * width * e
            if overlap:
                carry += max_batch * rate * dim * (e + 4)
            out["compressor_carry"] += carry
    return out
