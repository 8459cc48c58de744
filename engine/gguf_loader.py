"""Reads a llama.cpp GGUF file as a Hugging Face checkpoint: its metadata as a config.json-style
dict, its tensors under HF names, dequantized to float, in HF's row layout.

Supports the dense architectures llama, qwen2 and qwen3. llama.cpp's converter permutes the rows
of the llama q/k projections (interleaved rotary halves); this module undoes that, so the result
is the tensor transformers would hold. It never validates shapes against a family (that is
engine/checkpoint.py's job) and never reads the tokenizer (common/tokenizer.py does).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from common.gguf_metadata import GGUFFormatError, GGUFHeader, GGUFTensorInfo, read_gguf_header
from engine.errors import CheckpointError
from engine.models.registry import GGUF_ARCHITECTURES, GGUF_PERMUTED_QK

SUPPORTED_ARCHITECTURES = tuple(GGUF_ARCHITECTURES)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# The tokenizer's big arrays: common/tokenizer.py reads them, the engine does not keep them.
_TOKENIZER_ARRAYS = tuple(
    f"tokenizer.ggml.{k}" for k in ("tokens", "merges", "token_type", "scores")
)


def hf_tensor_name(gguf_name: str, file: Path) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    if gguf_name == "rope_freqs.weight":
        raise CheckpointError(
            f"{file}: tensor 'rope_freqs.weight' (llama3-style per-dimension rope factors baked "
            f"into the GGUF) is not supported; load the Hugging Face folder of this model instead"
        )
    raise CheckpointError(f"{file}: unexpected tensor {gguf_name!r} for a dense model")


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's ``permute`` of q/k rows: per head, rows were reordered from HF's
    [first half | second half] rotary layout to interleaved pairs. ``w``: [num_heads*head_dim, ...]."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """One GGUF file: ``hf_config`` (a config.json-style dict), ``shapes`` (HF name -> shape)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            header = read_gguf_header(self.path)
        except (OSError, GGUFFormatError) as e:
            raise CheckpointError(f"cannot read GGUF file {self.path}: {e}") from e
        self.metadata = {
            k: v for k, v in header.metadata.items() if not k.startswith(_TOKENIZER_ARRAYS)
        }
        self.architecture = str(self.metadata.get("general.architecture", ""))
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"{self.path}: unknown architecture {self.architecture!r} in general.architecture; "
                f"supported GGUF architectures: {list(SUPPORTED_ARCHITECTURES)}"
            )
        for t in header.tensors:
            _check_in_file(t, header, self.path)
        self._infos = {hf_tensor_name(t.name, self.path): t for t in header.tensors}
        self._data_offset = header.data_offset
        # ggml lists dimensions innermost first; HF/torch outermost first.
        self.shapes = {
            hf_tensor_name(t.name, self.path): tuple(reversed(t.shape)) for t in header.tensors
        }
        self.hf_config = self._hf_config()

    def file_of(self, name: str) -> Path:
        return self.path

    @property
    def files(self) -> list[Path]:
        return [self.path]

    def _hf_config(self) -> dict[str, Any]:
        arch, md = self.architecture, self.metadata

        def need(key: str) -> Any:
            full = f"{arch}.{key}"
            if full not in md:
                raise CheckpointError(f"{self.path}: metadata key {full!r} is missing")
            return md[full]

        num_heads = int(need("attention.head_count"))
        hidden = int(need("embedding_length"))
        head_dim = int(md.get(f"{arch}.attention.key_length") or hidden // num_heads)
        vocab = md.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = self.shapes["model.embed_tokens.weight"][0]
        d: dict[str, Any] = {
            "model_type": arch,
            "architectures": [GGUF_ARCHITECTURES[arch]],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(need("feed_forward_length")),
            "num_hidden_layers": int(need("block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(md.get(f"{arch}.attention.head_count_kv") or num_heads),
            "head_dim": head_dim,
            "rms_norm_eps": float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(md.get(f"{arch}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(md.get(f"{arch}.context_length", 4096)),
            "tie_word_embeddings": "lm_head.weight" not in self.shapes,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self.shapes,
            "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": [
                md[f"tokenizer.ggml.{k}"]
                for k in ("eos_token_id", "eot_token_id", "eom_token_id")
                if f"tokenizer.ggml.{k}" in md
            ],
            "dtype": "float32",  # what load() produces before the cast; the file is quantized
        }
        scaling_type = md.get(f"{arch}.rope.scaling.type")
        if scaling_type not in (None, "none"):
            d["rope_scaling"] = {
                "rope_type": scaling_type,
                "factor": float(md.get(f"{arch}.rope.scaling.factor", 1.0)),
                "original_max_position_embeddings": md.get(
                    f"{arch}.rope.scaling.original_context_length"
                ),
            }
        return d

    def load(
        self,
        names: Iterable[str],
        dtype: torch.dtype,
        device: str | torch.device,
        on_tensor: Callable[[str], None] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Dequantizes ``names`` to float32, un-permutes llama q/k, casts to ``dtype``."""
        num_heads = self.hf_config["num_attention_heads"]
        num_kv_heads = self.hf_config["num_key_value_heads"]
        try:  # tensor data is read from the page cache as each tensor is dequantized
            data = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read GGUF file {self.path}: {e}") from e
        out: dict[str, torch.Tensor] = {}
        for name in names:
            t = self._infos[name]
            qtype = GGMLQuantizationType(t.ggml_type)
            try:
                w = dequantize(_raw_view(data, self._data_offset, t), qtype)
                w = np.asarray(w, dtype=np.float32).reshape(self.shapes[name])
            except (NotImplementedError, ValueError) as e:
                raise CheckpointError(
                    f"{self.path}: cannot dequantize tensor {t.name!r} ({qtype.name}): {e}"
                ) from e
            if self.architecture in GGUF_PERMUTED_QK:
                if ".q_proj." in name:
                    w = unpermute_rows(w, num_heads)
                elif ".k_proj." in name:
                    w = unpermute_rows(w, num_kv_heads)
            tensor = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
            out[name] = tensor.to(dtype=dtype, device=device)
            if on_tensor is not None:
                on_tensor(name)
        return out


def _check_in_file(t: GGUFTensorInfo, header: GGUFHeader, path: Path) -> None:
    """A truncated download shows up here, before anything is dequantized."""
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
    except (KeyError, ValueError) as e:
        raise CheckpointError(
            f"{path}: tensor {t.name!r} has unknown ggml type {t.ggml_type}"
        ) from e
    num_elements = 1
    for d in t.shape:
        num_elements *= d
    end = header.data_offset + t.offset + num_elements // block * type_size
    if end > header.file_size:
        raise CheckpointError(
            f"{path}: tensor {t.name!r} ends at byte {end} but the file has {header.file_size} "
            f"bytes (truncated download?)"
        )


# ggml types stored as plain numpy arrays; every other type is packed blocks read as bytes.
_PLAIN_TYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


def _raw_view(data: np.ndarray, data_offset: int, t: GGUFTensorInfo) -> np.ndarray:
    """The tensor's bytes as gguf.quants.dequantize expects them (as GGUFReader lays them out)."""
    qtype = GGMLQuantizationType(t.ggml_type)
    dims = tuple(reversed(t.shape))
    block, type_size = GGML_QUANT_SIZES[qtype]
    num_elements = 1
    for d in dims:
        num_elements *= d
    start = data_offset + t.offset
    raw = data[start : start + num_elements // block * type_size]
    if qtype in _PLAIN_TYPES:
        return raw.view(_PLAIN_TYPES[qtype]).reshape(dims)
    return raw.reshape(quant_shape_to_byte_shape(dims, qtype))
