"""Loads a checkpoint for the engine: a Hugging Face folder (config.json + safetensors, single or
sharded), a .gguf file, or a folder holding exactly one .gguf.

Every tensor name and shape is checked against what the family needs (derived from ModelConfig)
before any weight is read, so a wrong checkpoint fails in a second with a message naming the file
and the tensor. The result is an HF-named state dict; this module never builds a model, never
allocates KV or workspace and never reads the tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from engine.errors import CheckpointError
from engine.model_config import ModelConfig
from engine.models.family import family_class
from engine.safetensors_loader import SafetensorsCheckpoint

if TYPE_CHECKING:  # the gguf package is imported only when a .gguf model is loaded
    from engine.gguf_loader import GGUFCheckpoint

# Tensors some writers add that no family reads; dropped without complaint.
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """An HF-named state dict cast to the serving dtype and placed on the device."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    source: Path
    model_fingerprint: str


def load_model_config(path: str | Path) -> ModelConfig:
    """The model's shape, without reading any weight (``path`` may also be a config.json)."""
    kind, resolved = _resolve(Path(path))
    if kind == "gguf":
        from engine.gguf_loader import GGUFCheckpoint  # gguf only for .gguf models

        return _gguf_config(GGUFCheckpoint(resolved))
    return _hf_config(resolved)


def load_checkpoint(
    path: str | Path,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    progress: bool = True,
    tensor_parallel: tuple[int, int] | None = None,
    load_format: str = "auto",
    seed: int = 0,
) -> LoadedCheckpoint:
    """Reads, validates and casts every weight; raises CheckpointError naming file and tensor.
    ``tensor_parallel=(rank, size)``: read only the slices that rank holds (the families that
    split, from safetensors; names and full shapes are checked first, as for one rank).
    ``load_format="dummy"``: no weight file is read; the family makes random weights of the
    checkpoint's shapes and formats on ``device`` from the config alone (``dummy_checkpoint``)."""
    if load_format == "dummy":
        if tensor_parallel is not None and tensor_parallel[1] > 1:
            raise CheckpointError("load_format=dummy runs on one rank (tensor_parallel_size 1)")
        return dummy_checkpoint(path, dtype, device, seed)
    if load_format != "auto":
        raise CheckpointError(f"load_format={load_format!r} is not one of auto, dummy")
    kind, resolved = _resolve(Path(path))
    source: GGUFCheckpoint | SafetensorsCheckpoint
    if kind == "gguf":
        from engine.gguf_loader import GGUFCheckpoint  # gguf only for .gguf models

        source = GGUFCheckpoint(resolved)
        config = _gguf_config(source)
    else:
        config = _hf_config(resolved)
        source = SafetensorsCheckpoint(resolved)
    names = _select_tensors(config, source)
    slice_of = None
    if tensor_parallel is not None and tensor_parallel[1] > 1:
        slice_of = _tensor_parallel_slicer(config, source, *tensor_parallel)
    with tqdm(
        total=len(names),
        desc=f"loading {config.name}",
        unit="tensor",
        file=sys.stderr,
        disable=not progress,
    ) as bar:

        def tick(_: str) -> None:
            bar.update(1)

        if isinstance(source, SafetensorsCheckpoint):
            # Families that dequantize themselves keep quantized payloads and their scales as
            # stored (the model decides, explicitly, whether to dequantize).
            family = family_class(config)
            keep = None if family.cast_weights_on_load else family.keeps_stored_dtype
            state_dict = source.load(names, dtype, device, tick,
                                     cast_all=family.cast_weights_on_load, keep_dtype=keep,
                                     slice_of=slice_of)
        else:
            state_dict = source.load(names, dtype, device, tick)
    return LoadedCheckpoint(
        config=config,
        state_dict=state_dict,
        source=resolved,
        model_fingerprint=model_fingerprint(config, {n: source.shapes[n] for n in names}),
    )


def dummy_checkpoint(path: str | Path, dtype: torch.dtype, device: str | torch.device,
                     seed: int = 0) -> LoadedCheckpoint:
    """Random weights for the config at ``path`` (a folder with config.json and no weights, a
    config.json, or a .gguf whose tensors are not read), made on ``device``. The fingerprint
    names the seed: two workers exchange KV only over the same dummy weights."""
    config = load_model_config(path)
    state_dict = dict(family_class(config).dummy_tensors(config, dtype, torch.device(device),
                                                         seed))
    return LoadedCheckpoint(config=config, state_dict=state_dict, source=_resolve(Path(path))[1],
                            model_fingerprint=dummy_fingerprint(config, state_dict, seed))


def dummy_fingerprint(cfg: ModelConfig, tensors: dict[str, torch.Tensor], seed: int) -> str:
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    shapes[f"load_format=dummy,seed={seed}"] = ()
    return model_fingerprint(cfg, shapes)


def _tensor_parallel_slicer(cfg: ModelConfig, source: Any, rank: int, size: int) -> Any:
    family = family_class(cfg)
    if not isinstance(source, SafetensorsCheckpoint) or not family.supports_tensor_parallel:
        raise CheckpointError(f"tensor_parallel_size={size}: sharded loading covers the "
                              "families that split, from safetensors; "
                              f"{cfg.family} from {source.files[0]} runs on one rank only")
    return family.tensor_slicer(cfg, rank, size, source.shapes)


def model_fingerprint(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> str:
    """sha256 over the config's shape fields (and rope, which shapes the stored K) and the sorted
    (name, shape) of the tensors: two workers agree on it iff their KV layouts are compatible."""
    fields: dict[str, Any] = {
        "family": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_layers": cfg.num_layers,
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "qk_norm": cfg.qk_norm,
        "rope": asdict(cfg.rope),
        "tensors": sorted((name, list(shape)) for name, shape in shapes.items()),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _select_tensors(cfg: ModelConfig, source: GGUFCheckpoint | SafetensorsCheckpoint) -> list[str]:
    """The names to load, after checking names and shapes against the family's layout."""
    present = source.shapes
    expected = family_class(cfg).checkpoint_tensors(cfg, present)
    if expected is None:  # the family checks names and shapes itself when it is built
        return sorted(present)
    for name, shape in expected.items():
        if name not in present:
            where = ", ".join(str(f) for f in source.files)
            raise CheckpointError(
                f"missing tensor {name!r} in {where} (family {cfg.family}, "
                f"{cfg.num_layers} layers per config)"
            )
        if tuple(present[name]) != shape:
            raise CheckpointError(
                f"unexpected shape for tensor {name!r} in {source.file_of(name)}: "
                f"{list(present[name])}, expected {list(shape)} from the config"
            )
    for name in present:
        if name in expected or name.endswith(_HARMLESS_SUFFIXES):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # some writers store the tied head anyway; the embedding is the truth
        raise CheckpointError(
            f"unexpected tensor {name!r} in {source.file_of(name)}: family {cfg.family} with this "
            f"config does not use it (attention_bias={cfg.attention_bias}, qk_norm={cfg.qk_norm}, "
            f"{cfg.num_layers} layers)"
        )
    return list(expected)


def _resolve(path: Path) -> tuple[str, Path]:
    """('hf', folder) or ('gguf', file)."""
    if path.is_file():
        if path.suffix == ".gguf":
            return "gguf", path
        if path.name == "config.json":
            return "hf", path.parent
        raise CheckpointError(f"{path} is neither a .gguf file, a config.json nor a folder")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if (path / "config.json").is_file():
        return "hf", path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    if len(ggufs) > 1:
        raise CheckpointError(
            f"{path} holds several .gguf files {[g.name for g in ggufs]}; pass the file itself"
        )
    raise CheckpointError(f"{path} has neither config.json nor a .gguf file")


def _hf_config(folder: Path) -> ModelConfig:
    config_file = folder / "config.json"
    d = _read_json(config_file)
    gen_file = folder / "generation_config.json"
    if gen_file.is_file():
        d["eos_token_id"] = _merge_ids(
            d.get("eos_token_id"), _read_json(gen_file).get("eos_token_id")
        )
    try:
        return ModelConfig.from_hf_dict(d, name=folder.name)
    except KeyError as e:
        raise CheckpointError(f"{config_file}: required field {e} is missing") from e
    except CheckpointError as e:
        raise CheckpointError(f"{config_file}: {e}") from e


def _gguf_config(source: GGUFCheckpoint) -> ModelConfig:
    name = str(source.metadata.get("general.name") or source.path.stem)
    try:
        return ModelConfig.from_hf_dict(source.hf_config, name=name)
    except CheckpointError as e:
        raise CheckpointError(f"{source.path}: {e}") from e


def _merge_ids(*values: Any) -> list[int]:
    ids: list[int] = []
    for v in values:
        for i in v if isinstance(v, list) else ([] if v is None else [v]):
            if int(i) not in ids:
                ids.append(int(i))
    return ids


def _read_json(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    if not isinstance(d, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return d
