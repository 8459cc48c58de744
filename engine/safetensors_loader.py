"""Reads the tensors of a Hugging Face checkpoint folder: one ``model.safetensors`` or shards
listed by ``model.safetensors.index.json``.

It indexes names, shapes and files first (headers only, no tensor data), so engine/checkpoint.py
can refuse a mis-shaped checkpoint before reading gigabytes. It never interprets tensor names,
never builds a model and never keeps a file open after ``load`` returns.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from engine.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Float dtypes that a cast to the serving dtype keeps meaningful; anything else (fp8, ints) is a
# quantized or integer payload whose meaning depends on other tensors (scales), so it stays as is.
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class SafetensorsCheckpoint:
    """The tensors of one HF folder: ``shapes`` (name -> shape) and ``file_of`` (name -> shard)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._file_of = _index_files(self.folder)
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file, names in _group_by_file(self._file_of).items():
            self.shapes.update(_read_shapes(file, names))

    def file_of(self, name: str) -> Path:
        return self._file_of[name]

    @property
    def files(self) -> list[Path]:
        return sorted(set(self._file_of.values()))

    def load(
        self,
        names: Iterable[str],
        dtype: torch.dtype,
        device: str | torch.device,
        on_tensor: Callable[[str], None] | None = None,
        cast_all: bool = True,
        keep_dtype: Callable[[str], bool] | None = None,
        slice_of: Callable[[str], Any] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Reads ``names``, casts floats to ``dtype`` and moves them to ``device``.

        ``cast_all=False`` leaves non-float payloads (fp8, ints) in their stored dtype;
        ``keep_dtype(name)`` True leaves that tensor as stored too (fp32 block scales, which a
        bf16 cast would round). ``slice_of(name)`` (tensor parallelism,
        engine/parallel/shard_plan.py) returns the ``TensorSlice`` a rank holds, or None for the
        whole tensor: only those bytes are read from the file (none for an ``absent`` slice: the
        name is then missing from the result).
        """
        wanted = set(names)
        out: dict[str, torch.Tensor] = {}
        for file, file_names in _group_by_file(self._file_of).items():
            selected = [n for n in file_names if n in wanted]
            if not selected:
                continue
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in selected:
                        part = slice_of(name) if slice_of is not None else None
                        if part is not None and part.absent:
                            continue  # another rank's: never read
                        tensor = f.get_tensor(name) if part is None else _read_slice(f, name, part)
                        target = dtype if cast_all or tensor.dtype in _CASTABLE else tensor.dtype
                        if keep_dtype is not None and keep_dtype(name):
                            target = tensor.dtype
                        # copy=True: never keep a view of the memory-mapped file; the weights
                        # must be resident memory the plan counted, not page cache.
                        out[name] = tensor.to(device=device, dtype=target, copy=True)
                        if on_tensor is not None:
                            on_tensor(name)
            except (OSError, RuntimeError, ValueError, SafetensorError) as e:
                raise CheckpointError(f"cannot read tensors from {file}: {e}") from e
        return out


def _read_slice(f: Any, name: str, part: Any) -> torch.Tensor:
    """Rows ``part.start : part.start + part.length`` of dim ``part.dim`` (0 or 1), read alone."""
    view = f.get_slice(name)
    if part.zero:  # an empty read gives the dtype without reading the tensor
        return torch.zeros(view.get_shape(), dtype=view[0:0].dtype)
    end = part.start + part.length
    return view[part.start:end] if part.dim == 0 else view[:, part.start:end]


def _index_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it, from the index when sharded."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot read shard index {index}: {e}") from e
        file_of = {name: folder / shard for name, shard in weight_map.items()}
        for name, file in file_of.items():
            if not file.is_file():
                raise CheckpointError(
                    f"{index} maps tensor {name!r} to {file.name}, which does not exist"
                )
        return file_of
    single = folder / SINGLE_FILE
    files = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(
            p.name for p in folder.glob("*.pt")
        )
        hint = f" (found {others}: only safetensors are supported)" if others else ""
        raise CheckpointError(f"no *.safetensors weights in {folder}{hint}")
    if len(files) > 1:
        raise CheckpointError(
            f"{folder} holds several safetensors files {[f.name for f in files]} but no {INDEX_FILE}"
        )
    names = _read_names(files[0])
    return {name: files[0] for name in names}


def _group_by_file(file_of: dict[str, Path]) -> dict[Path, list[str]]:
    groups: dict[Path, list[str]] = {}
    for name, file in file_of.items():
        groups.setdefault(file, []).append(name)
    return groups


def _read_names(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return list(f.keys())
    except (OSError, RuntimeError, ValueError, SafetensorError) as e:
        raise CheckpointError(f"cannot read safetensors file {file}: {e}") from e


def _read_shapes(file: Path, names: list[str]) -> dict[str, tuple[int, ...]]:
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            present = set(f.keys())
            shapes = {}
            for name in names:
                if name not in present:
                    raise CheckpointError(
                        f"missing tensor {name!r}: the shard index points at {file}, which lacks it"
                    )
                shapes[name] = tuple(f.get_slice(name).get_shape())
            return shapes
    except (OSError, RuntimeError, ValueError, SafetensorError) as e:
        raise CheckpointError(f"cannot read safetensors file {file}: {e}") from e
