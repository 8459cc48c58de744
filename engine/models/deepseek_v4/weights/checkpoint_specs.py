"""The tensors of a DeepSeek-V4 checkpoint as V4-Flash ships them: names in DeepSeek's own
on-disk layout (``layers.N.attn.wq_a.weight``, one ``ffn.experts.E.w1.weight`` per expert),
shapes, stored dtypes and how to fill each one. The one list both the on-disk writer
(lab.bench.deepseek_v4.write_checkpoint), the on-device builder (lab.bench.deepseek_v4.quantized_weights)
and the engine's dummy weights walk, so they cannot drift apart.

Shapes come from the engine's own model built on the meta device, its names mapped back through
the loader's rename tables (:mod:`engine.models.deepseek_v4.weights.checkpoint_layout`): whatever the loader
expects is what gets written. Stored dtypes follow the shipped files (the header of
``model-00002-of-00046.safetensors``): dense projections F8_E4M3 with an F8_E8M0 scale per
128 x 128 block, routed experts I8 (two e2m1 a byte) with an F8_E8M0 scale per 32 values,
``tid2eid`` I64, mHC / sinks / positional and routing biases F32, the rest (norms included)
BF16.
The engine uses it for ``load_format=dummy`` (:func:`dummy_state_dict`: random weights in the
formats the config declares, made layer by layer on the device); the benchmarks and tests use
it to write and build checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.model import _FP32_FRAGMENTS, DeepseekV4Model
from engine.models.deepseek_v4.weights.checkpoint_layout import (
    _COMPRESSOR_LEAVES,
    _LAYER_RENAMES,
    _TOP_RENAMES,
    to_hf_names,
)
from engine.models.deepseek_v4.weights.quant_weights import FP8_BLOCK, FP8_LINEAR
from kernels.mxfp4_moe_ref import MXFP4_GROUP

# How a tensor is filled: quantized payloads and their scales, the constant ones, the hash table.
FILLS = ("fp8", "fp8_scale", "mxfp4", "mxfp4_scale", "normal", "ones", "zeros", "tid2eid")
_FP8_SPREAD = 64.0  # stored e4m3 values ~N(0, 64): well inside +-448
_E8M0_FP8 = 115  # 2**(115 - 127) * 64 ~ 0.016: the spread of transformers' init (0.02)
_E8M0_FP4 = 120  # random e2m1 codes have std ~2.9; 2.9 * 2**(120 - 127) ~ 0.023
_E8M0 = torch.float8_e8m0fnu


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor: DeepSeek-layout ``name``, ``shape``, stored ``dtype``, ``fill``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: str

    def __post_init__(self) -> None:
        assert self.fill in FILLS, self.fill

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def _inverse_layer_rest(rest: str) -> str:
    """transformers ``layers.N.<rest>`` -> DeepSeek's, undoing the loader's renames (the longest
    matching new prefix wins, as ``indexer.scorer.weights_proj`` sits inside ``indexer``)."""
    for marker in ("self_attn.compressor.indexer.", "self_attn.compressor."):
        if rest.startswith(marker):
            leaf = rest[len(marker):]
            for old, new in _COMPRESSOR_LEAVES:
                if leaf.startswith(new):
                    rest = marker + old + leaf[len(new):]
                    break
            break
    matches = [(old, new) for old, new in _LAYER_RENAMES if rest.startswith(new)]
    if not matches:
        raise AssertionError(f"no DeepSeek name for transformers tensor layers.N.{rest}")
    old, new = max(matches, key=lambda m: len(m[1]))  # ties: the first, the shipped files' name
    return old + rest[len(new):]


def deepseek_name(hf_name: str) -> str:
    """The DeepSeek-layout name of a (non-expert) transformers tensor name."""
    top = {new: old for old, new in reversed(list(_TOP_RENAMES.items()))}  # first = DeepSeek's
    if hf_name in top:
        return top[hf_name]
    model, layers, layer, rest = hf_name.split(".", 3)
    assert (model, layers) == ("model", "layers"), hf_name
    return f"layers.{layer}.{_inverse_layer_rest(rest)}"


def _float_spec(name: str, hf_name: str, shape: tuple[int, ...]) -> TensorSpec:
    # norm weights ship in BF16 (the model holds them in fp32 all the same); mHC, sinks,
    # positional biases and routing biases in F32
    fp32 = any(f in hf_name for f in _FP32_FRAGMENTS) and "norm" not in name
    dtype = torch.float32 if fp32 else torch.bfloat16
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name or leaf.endswith("scale"):  # RMSNorm weights, mHC scales
        fill = "ones"
    elif leaf.endswith(("base", "ape", "attn_sink", "bias")):
        fill = "zeros"
    else:
        fill = "normal"
    return TensorSpec(name, shape, dtype, fill)


def _expert_specs(stem: str, num_experts: int, inter: int, hidden: int) -> Iterator[TensorSpec]:
    """Per expert: w1 (gate) and w3 (up) [inter, hidden], w2 (down) [hidden, inter], each packed
    two values a byte with one e8m0 scale per 32 values, as the shipped files hold them."""
    for e in range(num_experts):
        for w, (rows, cols) in (("w1", (inter, hidden)), ("w2", (hidden, inter)), ("w3", (inter, hidden))):
            yield TensorSpec(f"{stem}{e}.{w}.weight", (rows, cols // 2), torch.int8, "mxfp4")
            yield TensorSpec(f"{stem}{e}.{w}.scale", (rows, cols // MXFP4_GROUP), _E8M0, "mxfp4_scale")


def checkpoint_specs(cfg: DeepseekV4Config, fp8: bool = True,
                     fp4: bool = True) -> Iterator[TensorSpec]:
    """Every tensor of ``cfg``'s checkpoint in file order (embedding, layer by layer, head):
    dense projections in FP8 with block scales when ``fp8``, routed experts in MXFP4 when
    ``fp4`` (else both BF16, as an unquantized checkpoint stores them)."""
    if fp4 and (cfg.hidden_size % MXFP4_GROUP or cfg.moe_intermediate_size % MXFP4_GROUP):
        raise ValueError(f"MXFP4 experts need hidden_size ({cfg.hidden_size}) and "
                         f"moe_intermediate_size ({cfg.moe_intermediate_size}) in multiples of {MXFP4_GROUP}")
    with torch.device("meta"):
        meta = DeepseekV4Model(cfg)
    for hf_name, t in list(meta.named_parameters()) + list(meta.named_buffers()):
        shape = tuple(t.shape)
        if "rotary" in hf_name or hf_name.endswith("experts.down_proj"):
            continue  # rotary tables are computed; down_proj is written with its gate_up_proj
        if hf_name.endswith("experts.gate_up_proj"):
            e, two_inter, hidden = shape
            layer = hf_name.split(".")[2]
            stem = f"layers.{layer}.ffn.experts."
            if fp4:
                yield from _expert_specs(stem, e, two_inter // 2, hidden)
            else:
                for i in range(e):
                    for w, sh in (("w1", (two_inter // 2, hidden)), ("w2", (hidden, two_inter // 2)),
                                  ("w3", (two_inter // 2, hidden))):
                        yield TensorSpec(f"{stem}{i}.{w}.weight", sh, torch.bfloat16, "normal")
            continue
        name = deepseek_name(hf_name)
        if fp8 and FP8_LINEAR.search(hf_name):
            n, k = shape
            yield TensorSpec(name, shape, torch.float8_e4m3fn, "fp8")
            grid = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
            yield TensorSpec(name[: -len("weight")] + "scale", grid, _E8M0, "fp8_scale")
        elif hf_name.endswith("tid2eid"):
            yield TensorSpec(name, shape, torch.int64, "tid2eid")
        elif not t.is_floating_point():
            yield TensorSpec(name, shape, t.dtype, "zeros")
        else:
            yield _float_spec(name, hf_name, shape)


@torch.no_grad()
def make_tensor(spec: TensorSpec, cfg: DeepseekV4Config, gen: torch.Generator,
                device: torch.device | str = "cpu", float_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``spec`` filled with random values of transformers' init spread (about 0.02 once
    dequantized), quantized ones made directly in their stored form (no full-precision copy).
    ``float_dtype``: makes the BF16 tensors in this dtype instead (the serving dtype)."""
    shape, fill = spec.shape, spec.fill
    if fill == "fp8":
        return (torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16)
                * _FP8_SPREAD).clamp(-448, 448).to(torch.float8_e4m3fn)
    if fill in ("fp8_scale", "mxfp4_scale"):
        byte = _E8M0_FP8 if fill == "fp8_scale" else _E8M0_FP4
        return torch.full(shape, byte, dtype=torch.uint8, device=device).view(_E8M0)
    if fill == "mxfp4":
        return torch.randint(0, 256, shape, device=device, generator=gen, dtype=torch.uint8).view(torch.int8)
    if fill == "tid2eid":
        r = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=gen, device=device)
        return r.argsort(dim=1)[:, : cfg.num_experts_per_tok].contiguous()
    dtype = float_dtype if float_dtype is not None and spec.dtype == torch.bfloat16 else spec.dtype
    if fill == "ones":
        return torch.ones(shape, dtype=dtype, device=device)
    if fill == "zeros":
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)


@torch.no_grad()
def dummy_state_dict(cfg: DeepseekV4Config, dtype: torch.dtype, device: torch.device | str,
                     seed: int, fp8: bool, fp4: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """``load_format=dummy``: the transformers-named tensors the loader would hand over for a
    checkpoint of ``cfg`` in the declared formats, made on ``device`` one layer at a time (the
    embedding first, the head last) and yielded as they are ready, so a consumer that packs
    them (weight_share.py) never holds two copies of more than one layer. ``device="meta"``
    gives the names, shapes and dtypes alone. The same seed gives the same values."""
    meta = torch.device(device).type == "meta"
    gen = None if meta else torch.Generator(device=device).manual_seed(seed)
    group: dict[str, torch.Tensor] = {}
    current: str | None = None
    for spec in checkpoint_specs(cfg, fp8, fp4):
        key = ".".join(spec.name.split(".")[:2]) if spec.name.startswith("layers.") else "top"
        if key != current and group:
            yield from to_hf_names(group, dtype, keep_quantized=True, consume=True).items()
            group = {}
        current = key
        if meta:
            sdt = dtype if spec.dtype == torch.bfloat16 else spec.dtype
            group[spec.name] = torch.empty(spec.shape, dtype=sdt, device="meta")
        else:
            group[spec.name] = make_tensor(spec, cfg, gen, device, float_dtype=dtype)
    if group:
        yield from to_hf_names(group, dtype, keep_quantized=True, consume=True).items()
