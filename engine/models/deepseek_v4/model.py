"""The DeepSeek-V4 causal LM for the engine: HF tensor names, flat multi-sequence steps.

``forward`` takes the concatenated tokens of all scheduled sequences (each a chunk of prefill or
one decode token) with per-sequence cache slots and block tables, extends each sequence's state in
:class:`DeepseekV4KVPool`, and returns the final hidden states; ``compute_logits`` applies the
LM head into a caller-given buffer. Never allocates cache memory and never grows the extent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from engine.errors import CheckpointError, InvalidRequest
from engine.models.deepseek_v4.backend import V4Backend
from engine.models.deepseek_v4.config import SLIDING, DeepseekV4Config
from engine.models.deepseek_v4.layers.attention import V4Attention
from engine.models.deepseek_v4.layers.decoder import V4Backbone
from engine.models.deepseek_v4.layers.merged_groups import merge_projections
from engine.models.deepseek_v4.layers.mhc import merge
from engine.models.deepseek_v4.layers.norms import RMSNorm, rms_norm_row
from engine.models.deepseek_v4.layers.rope import Rope, rotaries
from engine.models.deepseek_v4.memory.kv_pool import DeepseekV4KVPool, LayerPool
from engine.models.deepseek_v4.step.chunk_attention import attend_step
from engine.models.deepseek_v4.step.chunk_rows import ChunkRows, ChunkSpan
from engine.models.deepseek_v4.step.decode_rows import DecodeRows, DecodeSpans
from engine.models.deepseek_v4.step.decode_step import (
    DecodeLoop,
    attend_decode_layer,
    fused_decode_layers,
)
from engine.models.deepseek_v4.step.rows import SeqSpan, to_device
from engine.models.deepseek_v4.weights.checkpoint_layout import (
    hf_quantized_names,
    is_deepseek_layout,
    to_hf_names,
)
from engine.models.deepseek_v4.weights.quant_modules import Fp8Linear, Mxfp4Experts, bind_workspace
from engine.models.deepseek_v4.weights.quant_weights import (
    WEIGHT_FORMATS,
    dequantize_all,
    fp8_block_of,
    keep_quantized,
    quantized_weights,
    scale_name,
)
from engine.models.deepseek_v4.weights.swap_quantized import swap_quantized_modules

# Parameters transformers keeps in fp32 whatever the checkpoint dtype (by name fragment).
_FP32_FRAGMENTS = (
    "attn_hc.", "ffn_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias",
    "q_a_norm.", "kv_norm.", "input_layernorm.", "post_attention_layernorm.", "model.norm.",
)



class DeepseekV4Model(nn.Module):
    """``state_dict()`` names equal transformers' ``DeepseekV4ForCausalLM`` (minus the MTP
    layers, which transformers ignores too)."""

    # an MTP drafter (step/mtp_drafter.py) reads the last step's streams before the mHC head
    keep_streams: bool = False
    last_streams: torch.Tensor | None = None  # [N, hc, hidden]

    def __init__(self, cfg: DeepseekV4Config, backend: V4Backend | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend or V4Backend()
        self.model = V4Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.main_rotary, self.compress_rotary = rotaries(cfg)

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def empty(
        cls, cfg: DeepseekV4Config, dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu", backend: V4Backend | None = None,
    ) -> DeepseekV4Model:
        """Uninitialised weights on ``device``: ``dtype``, except the tensors transformers keeps
        in fp32 (norms, mHC, sinks, position and routing biases)."""
        with torch.device("meta"):
            model = cls(cfg, backend)
        model.to_empty(device=device)
        model.main_rotary, model.compress_rotary = (r.to(device) for r in rotaries(cfg))
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "rotary" in name or not t.is_floating_point():
                continue
            want = torch.float32 if any(f in name for f in _FP32_FRAGMENTS) else dtype
            if t.dtype != want:
                _replace(model, name, torch.empty(t.shape, dtype=want, device=t.device))
        return model.eval()

    @classmethod
    def from_state_dict(
        cls, cfg: DeepseekV4Config, state_dict: Mapping[str, torch.Tensor],
        dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
        backend: V4Backend | None = None, weight_format: str = "checkpoint",
        consume: bool = False, shard: Callable[[nn.Module], None] | None = None,
    ) -> DeepseekV4Model:
        """The model holding ``state_dict``'s tensors (transformers names, or DeepSeek's own
        layout, renamed and experts merged by :mod:`.weights.checkpoint_layout`). ``weight_format``:
        ``checkpoint`` keeps FP8 / MXFP4 payloads as stored (the quantized layers of
        :mod:`.weights.quant_modules`), ``dequantize`` turns them into ``dtype``. Tensors already in
        their final dtype on ``device`` are adopted, not copied, so loading never holds two
        copies of a weight. Raises CheckpointError naming missing, unexpected or mis-shaped
        tensors. ``consume``: ``state_dict`` is given up (the engine's), and per-expert tensors
        leave it as soon as they are stacked. ``shard``: gives the skeleton one tensor-parallel
        rank's shapes before the tensors (that rank's slices) are adopted."""
        if weight_format not in WEIGHT_FORMATS:
            raise CheckpointError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
        if is_deepseek_layout(state_dict):
            sd = to_hf_names(state_dict, dtype, keep_quantized=True, consume=consume)
        else:
            sd = hf_quantized_names(state_dict)
        sd = dequantize_all(sd, dtype) if weight_format == "dequantize" else keep_quantized(sd)
        sd = {k: v for k, v in sd.items() if not k.startswith("mtp.") and ".mtp." not in k}
        if cfg.tie_word_embeddings and "lm_head.weight" not in sd:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        kinds = quantized_weights(sd)
        with torch.device("meta"):
            model = cls(cfg, backend)
        swap_quantized_modules(model, kinds)
        if shard is not None:
            shard(model)
        own = dict(model.named_parameters()) | dict(model.named_buffers())
        own = {k: v for k, v in own.items() if "rotary" not in k}
        missing = sorted(set(own) - set(sd))
        unexpected = sorted(set(sd) - set(own))
        if missing or unexpected:
            raise CheckpointError(
                f"deepseek_v4 state dict mismatch: missing {missing[:8]} ({len(missing)}), "
                f"unexpected {unexpected[:8]} ({len(unexpected)})"
            )
        quantized = set(kinds) | {scale_name(w) for w in kinds}
        for name, meta in own.items():
            src = sd[name]
            if name in quantized:
                want = src.dtype  # payloads as stored, scales as keep_quantized made them
            elif meta.is_floating_point():
                want = torch.float32 if any(f in name for f in _FP32_FRAGMENTS) else dtype
            else:
                want = meta.dtype
            if tuple(src.shape) != tuple(meta.shape) and not name.endswith(".scale"):
                raise CheckpointError(
                    f"deepseek_v4 tensor {name}: checkpoint shape {tuple(src.shape)}, "
                    f"expected {tuple(meta.shape)}"
                )
            _replace(model, name, src.to(device=device, dtype=want))
        gemm_kernels = (backend or V4Backend()).resolved(torch.device(device)).gemm == "kernels"
        for name, mod in model.named_modules():
            if isinstance(mod, Fp8Linear):
                mod.block = fp8_block_of(name, mod.weight.shape, mod.scale.shape)
            if isinstance(mod, Fp8Linear | Mxfp4Experts):
                mod.use_kernels = gemm_kernels
        del own, src, meta
        # projections of one input as one GEMM over concatenated weights (merged_groups.py):
        # the parts' tensors become views of it, and each group's originals leave our dict
        # and (``consume``) the caller's as soon as it merged, so they are freed group by group
        dicts = [sd] + ([state_dict] if consume and isinstance(state_dict, dict) else [])

        def key(t: torch.Tensor) -> tuple:  # the same memory (a Parameter wraps its source)
            return t.device, t.data_ptr(), t.dtype, tuple(t.shape)

        names: list[dict[tuple, list[str]]] = []
        for d in dicts:
            by_mem: dict[tuple, list[str]] = {}
            for k, v in d.items():
                by_mem.setdefault(key(v), []).append(k)
            names.append(by_mem)

        def drop(old: list[torch.Tensor]) -> None:
            for d, by_mem in zip(dicts, names, strict=True):
                for t in old:
                    for k in by_mem.pop(key(t), ()):
                        del d[k]

        if merge_projections(model, drop) and torch.device(device).type == "cuda" and consume:
            torch.cuda.empty_cache()  # start-up only: hand the freed originals back
        del sd
        model.main_rotary, model.compress_rotary = (r.to(device) for r in rotaries(cfg))
        return model.eval()

    # --- step --------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_start_loc: Sequence[int],
        cache_slots: Sequence[int],
        cache: DeepseekV4KVPool,
        ws: object | None = None,
        block_tables: Sequence[Sequence[int]] | None = None,
        block_tables_t: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [N] (sequence i owns rows ``query_start_loc[i]:[i+1]``, at
        consecutive positions from its slot's ``num_tokens``). ``block_tables[i]``: sequence
        i's blocks in the pool (None: each slot's own run of a ``for_slots`` pool). Returns
        hidden [N, hidden]. ``ws``: the engine's Workspace (kernel scratch comes from it).
        ``block_tables_t``: the same tables on the device, [B, width] null-padded (optional).
        A step of one token per sequence runs batched (:meth:`forward_decode`)."""
        backend = self.backend.resolved(input_ids.device)
        if len(set(cache_slots)) != len(cache_slots):
            raise InvalidRequest(f"a cache slot appears twice in one step: {list(cache_slots)}",
                                 field="cache_slots")
        spans, host_ids = [], []
        for i, slot in enumerate(cache_slots):
            b, e = int(query_start_loc[i]), int(query_start_loc[i + 1])
            if not 0 <= slot < cache.max_batch:
                raise InvalidRequest(f"cache slot {slot} outside [0, {cache.max_batch})", field="cache_slots")
            ids = None if block_tables is None else block_tables[i]
            if ids is None:
                assert cache.static_tables is not None, "no block table given and no static tables"
                ids = cache.static_tables[slot]
            host_ids.append(list(ids))
            if e - b == 1:  # host tables only: one-token rows address blocks through DecodeRows
                table = torch.as_tensor(host_ids[-1], dtype=torch.long)
            else:
                table = cache.table(slot, ids)
            cache.check_room(slot, e - b, table)
            spans.append(SeqSpan(b, e, slot, cache.num_tokens[slot], table))
        singles = [i for i, sp in enumerate(spans) if sp.end - sp.begin == 1]
        if spans and len(singles) == len(spans):
            rows = _decode_rows(spans, singles, positions, block_tables_t)
            hidden = self.forward_decode(input_ids, rows.rows, cache, ws)
        else:
            decode = None
            if singles:  # a mixed step: its decode tokens run batched, the chunks one by one
                decode = _decode_rows(spans, singles, positions, block_tables_t)
                for i in singles:  # as the chunk path's layer 0 would, unless the family did
                    sp = spans[i]
                    if not cache.windows.take_plan(sp.slot, sp.start_pos, 1):
                        cache.windows.plan_step(sp.slot, sp.table.tolist(), sp.start_pos, 1,
                                                cache.block_size)
            multi = [i for i, sp in enumerate(spans) if sp.end - sp.begin > 1]
            chunks = [spans[i] for i in multi]
            rows = self._chunk_rows(chunks, [host_ids[i] for i in multi], cache, input_ids)
            hidden = self._layers(input_ids, positions, cache, ws, lambda attn, x, rope, lc: (
                attend_step(attn, x, rope, self.compress_rotary, chunks, lc, backend, ws, decode,
                            rows)))
            for sp in chunks:
                cache.windows.finish_step(sp.slot)
        for i in singles:  # the one-token rows wrote only the rings: snapshots come from them
            cache.snapshot_from_rings(spans[i].slot)
        for sp in spans:
            cache.num_tokens[sp.slot] = sp.start_pos + (sp.end - sp.begin)
        return hidden

    def _chunk_rows(self, chunks: list[SeqSpan], block_ids: list[list[int]],
                    cache: DeepseekV4KVPool, input_ids: torch.Tensor) -> ChunkRows:
        """The step's chunk addressing (step/chunk_rows.py), with the window snapshot each chunk's
        step plans (unless the family planned it already) from the host block tables."""
        cfg = self.cfg
        for sp, ids in zip(chunks, block_ids, strict=True):
            if not cache.windows.take_plan(sp.slot, sp.start_pos, sp.end - sp.begin):
                cache.windows.plan_step(sp.slot, ids, sp.start_pos, sp.end - sp.begin,
                                        cache.block_size)
        rates = [cfg.rate(lt) for lt in cfg.layer_types if lt != SLIDING]
        rows = ChunkRows([ChunkSpan(sp.begin, sp.end - sp.begin, sp.slot, sp.start_pos, ids)
                          for sp, ids in zip(chunks, block_ids, strict=True)],
                         int(input_ids.shape[0]), cfg.sliding_window, cache.block_size, rates,
                         input_ids.device)
        rows.snapshot = cache.windows.chunk_writes([sp.slot for sp in chunks], rows.offsets)
        return rows

    @torch.no_grad()
    def forward_decode(self, input_ids: torch.Tensor, rows: DecodeRows, cache: DeepseekV4KVPool,
                       ws: object | None = None) -> torch.Tensor:
        """One token for each sequence of ``rows``, all sequences at once, in device work only
        (no host bookkeeping: the caller keeps ``cache.num_tokens``; what a CUDA graph
        replays). input_ids: [B]. Returns hidden [B, hidden]. The loop is the backend's
        (step/decode_step.py)."""
        backend = self.backend.resolved(input_ids.device)
        if DecodeLoop.of(backend) is DecodeLoop.FUSED:
            return fused_decode_layers(self, self.model, (self.main_rotary, self.compress_rotary),
                                       input_ids, rows, cache, ws, backend)
        return self._layers(input_ids, rows.positions, cache, ws, lambda attn, x, rope, lc: (
            attend_decode_layer(attn, x, rope, self.compress_rotary, rows, lc, backend)))

    def _layers(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: DeepseekV4KVPool,
                ws: object | None,
                attend: Callable[[V4Attention, torch.Tensor, Rope, LayerPool], torch.Tensor]
                ) -> torch.Tensor:
        """Embedding, every decoder layer (``attend(attn, x, rope, layer_pool)`` runs the
        attention part), the final mHC head and norm -> hidden [N, hidden]."""
        cfg = self.cfg
        bind_workspace(self, ws)  # the FP8 linears' prefill path takes its scratch from it
        x = self.model.embed_tokens(input_ids)  # [N, hidden]
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()  # [N, hc, hidden]
        kernels = self.backend.resolved(input_ids.device).mhc == "kernels"  # Sinkhorn, collapse, merge
        ropes = {
            True: self.main_rotary(positions, x.dtype),
            False: self.compress_rotary(positions, x.dtype),
        }
        for layer, lc in zip(self.model.layers, cache.layers, strict=True):
            attn: V4Attention = layer.self_attn
            post, comb, collapsed = layer.attn_hc(streams, kernels)
            a = attend(attn, _norm(layer.input_layernorm, collapsed, kernels),
                       ropes[attn.layer_type == SLIDING], lc)
            streams = merge(post, comb, a, streams, kernels)
            post, comb, collapsed = layer.ffn_hc(streams, kernels)
            m = layer.mlp(_norm(layer.post_attention_layernorm, collapsed, kernels), input_ids, ws)
            streams = merge(post, comb, m, streams, kernels)
        if self.keep_streams:
            self.last_streams = streams
        return self.model.norm(self.model.hc_head(streams, kernels))

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] (written into ``out`` when given)."""
        w = self.lm_head.weight
        if out is None:
            return hidden @ w.t()
        if out.dtype == hidden.dtype == w.dtype and out.is_contiguous():
            return torch.mm(hidden, w.t(), out=out)  # no [n, vocab] temporary
        out.copy_(hidden @ w.t())
        return out


def _norm(norm: RMSNorm, x: torch.Tensor, kernels: bool) -> torch.Tensor:
    """A block's input RMSNorm; ``kernels``: one launch in place on ``x`` (the mHC collapse's
    fresh output) instead of PyTorch's fp32 copy, fp32 norm and cast back (~160 MiB written at
    a 4096-token chunk, twice a layer)."""
    return rms_norm_row(x, norm.weight, norm.eps) if kernels else norm(x)


def _decode_rows(spans: list[SeqSpan], singles: list[int], positions: torch.Tensor,
                 block_tables_t: torch.Tensor | None) -> DecodeSpans:
    """The addressing of the step's one-token spans ``spans[i] for i in singles`` (host block
    tables on the spans; ``block_tables_t``: every span's on the device, [B, width]), built
    once for all layers: one copy of slots and tables to the device, none per layer."""
    dev = positions.device
    picked = [spans[i] for i in singles]
    first, last = picked[0].begin, picked[-1].begin
    if last - first == len(picked) - 1:  # contiguous rows: views, no gathers
        index: slice | torch.Tensor = slice(first, last + 1)
    else:
        index = to_device(torch.tensor([sp.begin for sp in picked]), dev)
    if block_tables_t is not None:
        sel = (slice(singles[0], singles[-1] + 1) if singles[-1] - singles[0] == len(singles) - 1
               else to_device(torch.tensor(singles), dev))
        tables = block_tables_t[sel].to(torch.long)
    else:
        host = torch.zeros(len(picked), max(sp.table.numel() for sp in picked), dtype=torch.long)
        for i, sp in enumerate(picked):
            host[i, : sp.table.numel()] = sp.table
        tables = to_device(host, dev)
    slots = to_device(torch.tensor([sp.slot for sp in picked]), dev)
    return DecodeSpans(DecodeRows(slots, positions[index], tables), index)


def _replace(model: nn.Module, name: str, new: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    if attr in mod._parameters:
        mod._parameters[attr] = nn.Parameter(new, requires_grad=False)
    else:
        mod._buffers[attr] = new
