"""One copy of the weights for several engine processes on one GPU (one-box mode).

The first process to start loads the checkpoint, packs every weight into ONE contiguous device
arena (dense families: q/k/v and gate/up already concatenated, the way the fused path wants
them) and, once its own warm-up is done, writes a handle file: the arena's CUDA IPC handle
(``torch.multiprocessing.reductions``) plus where each tensor lives in it. Later processes map
that arena instead of loading: their weights are views into memory another process owns, so the
device holds the weights once. Which process loads is decided by an exclusive lock file, so both
workers can be started together.

Accounting: the exporter's plan counts the arena as its ``weights`` (owned); an importer's plan
counts ``weights`` 0 and lists the arena as ``weights_mapped`` (not part of its total), and
subtracts the exporter's device bytes from what it measures as "CUDA context and libraries".

Never allocates after the engine's warm-up; never used without CUDA (refused with a clear error).
The exporter must outlive the importers (the mapping is only valid while it holds the arena).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.checkpoint import dummy_fingerprint, load_checkpoint, load_model_config
from engine.errors import PlanError
from engine.models.family import family_class

ALIGN = 512  # bytes: as the caching allocator aligns a tensor (same GEMM kernels chosen)
HANDLE_VERSION = 1
# (fused name, its parts in row order): what the dense fused path concatenates at load
DENSE_FUSIONS = (
    ("self_attn.qkv_proj.weight",
     ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    ("self_attn.qkv_proj.bias",
     ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
    ("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
)


@dataclass(frozen=True)
class ArenaEntry:
    name: str
    offset: int  # bytes from the arena's start
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch."


@dataclass
class SharedWeights:
    """The arena and what the engine reads from it (views; no tensor owns memory of its own)."""

    arena: torch.Tensor  # [nbytes] uint8 on the device
    entries: tuple[ArenaEntry, ...]
    owned: bool  # True in the process that loaded (and exports), False where it is mapped
    exporter_device_bytes: int = 0  # importers: device bytes the exporter held at export

    @property
    def nbytes(self) -> int:
        return self.arena.numel()

    def tensors(self) -> dict[str, torch.Tensor]:
        """name -> view of the arena; the parts of a fused tensor are row slices of it."""
        out = {e.name: _view(self.arena, e) for e in self.entries if "#rows=" not in e.name}
        parts_of = dict(DENSE_FUSIONS)
        for e in self.entries:
            if "#rows=" not in e.name:
                continue
            fused_name, rows = e.name.split("#rows=")
            fused = next(f for f in parts_of if fused_name.endswith(f))
            prefix = fused_name[: -len(fused)]
            whole, row = out[fused_name], 0
            for part, n in zip(parts_of[fused], (int(x) for x in rows.split(",")), strict=True):
                out[prefix + part] = whole[row: row + n]
                row += n
        return out


def _view(arena: torch.Tensor, e: ArenaEntry) -> torch.Tensor:
    dtype = getattr(torch, e.dtype)
    numel = 1
    for s in e.shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return arena[e.offset: e.offset + nbytes].view(dtype).view(e.shape)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def arena_layout(weights: dict[str, torch.Tensor]) -> tuple[tuple[ArenaEntry, ...], int]:
    """Where each tensor goes: fused groups (dense layers) as one entry each, plus a zero-size
    ``<fused>#rows=a,b,c`` entry recording how its rows split back into the parts."""
    entries: list[ArenaEntry] = []
    offset = 0
    taken: set[str] = set()
    for name in sorted(weights):
        if name in taken:
            continue
        group = _fusion_of(name, weights)
        if group is None:
            t = weights[name]
            entries.append(ArenaEntry(name, offset, tuple(t.shape), _dtype_name(t.dtype)))
            offset = _align(offset + t.numel() * t.element_size())
            continue
        fused, parts = group
        tensors = [weights[p] for p in parts]
        shape = (sum(t.shape[0] for t in tensors), *tensors[0].shape[1:])
        entries.append(ArenaEntry(fused, offset, shape, _dtype_name(tensors[0].dtype)))
        rows = ",".join(str(t.shape[0]) for t in tensors)
        entries.append(ArenaEntry(f"{fused}#rows={rows}", offset, (0,), "uint8"))
        offset = _align(offset + sum(t.numel() * t.element_size() for t in tensors))
        taken.update(parts)
    return tuple(entries), offset


def _fusion_of(name: str, weights: dict[str, torch.Tensor]) -> tuple[str, list[str]] | None:
    for fused, parts in DENSE_FUSIONS:
        for part in parts:
            if name.endswith(part):
                prefix = name[: -len(part)]
                names = [prefix + p for p in parts]
                if all(n in weights for n in names) and \
                        len({weights[n].dtype for n in names}) == 1 and \
                        len({tuple(weights[n].shape[1:]) for n in names}) == 1:
                    return prefix + fused, names
                return None
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack(weights: dict[str, torch.Tensor], device: torch.device) -> SharedWeights:
    """Copy ``weights`` (any device) into one new arena on ``device``, dropping each source from
    the dict as soon as it is copied (a host-loaded checkpoint never has two device copies)."""
    entries, nbytes = arena_layout(weights)
    arena = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for e in entries:
        if "#rows=" in e.name:
            continue
        dst = _view(arena, e)
        if e.name in weights:
            dst.copy_(weights.pop(e.name))
            continue
        fused = next(f for f, _ in DENSE_FUSIONS if e.name.endswith(f))
        prefix = e.name[: -len(fused)]
        row = 0
        for part in dict(DENSE_FUSIONS)[fused]:
            src = weights.pop(prefix + part)
            dst[row: row + src.shape[0]].copy_(src)
            row += src.shape[0]
    assert not weights, f"weights left out of the arena: {sorted(weights)[:4]}"
    return SharedWeights(arena, entries, owned=True)


def pack_stream(layout: dict[str, torch.Tensor], tensors: Iterable[tuple[str, torch.Tensor]],
                device: torch.device) -> SharedWeights:
    """``pack`` for weights made a few at a time (``load_format=dummy``): the arena is laid out
    from ``layout`` (the same names, shapes and dtypes, on the meta device), then each tensor is
    copied in as it arrives and dropped, so the device holds the arena and one layer more."""
    entries, nbytes = arena_layout(layout)
    arena = torch.empty(nbytes, dtype=torch.uint8, device=device)
    by_name = {e.name: e for e in entries}
    place: dict[str, tuple[ArenaEntry, int | None]] = {
        e.name: (e, None) for e in entries if "#rows=" not in e.name}
    for e in entries:
        if "#rows=" not in e.name:
            continue
        fused_name, rows = e.name.split("#rows=")
        fused = next(f for f, _ in DENSE_FUSIONS if fused_name.endswith(f))
        prefix, row = fused_name[: -len(fused)], 0
        for part, n in zip(dict(DENSE_FUSIONS)[fused], (int(x) for x in rows.split(",")),
                           strict=True):
            place[prefix + part] = (by_name[fused_name], row)
            place.pop(fused_name, None)
            row += n
    for name, t in tensors:
        if name not in place:
            raise PlanError(f"share_weights: tensor {name!r} was not in the arena's layout")
        entry, row = place.pop(name)
        dst = _view(arena, entry)
        (dst if row is None else dst[row: row + t.shape[0]]).copy_(t)
    assert not place, f"arena slots never filled: {sorted(place)[:4]}"
    return SharedWeights(arena, entries, owned=True)


def export(shared: SharedWeights, path: Path, meta: dict) -> None:
    """Write the handle file (atomically: a reader never sees half of it), with ``meta`` (the
    model path and fingerprint) for importers to check. CUDA only."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not shared.arena.is_cuda:
        raise PlanError("share_weights needs a CUDA device (CUDA IPC); this engine runs on "
                        f"{shared.arena.device}")
    free, total = torch.cuda.mem_get_info(shared.arena.device)
    buf = io.BytesIO()
    pickle.dump({"version": HANDLE_VERSION, "pid": os.getpid(),
                 "reduced": reduce_tensor(shared.arena),
                 "entries": [e.__dict__ for e in shared.entries],
                 "exporter_device_bytes": total - free, "meta": meta}, buf)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(path)


def map_exported(data: dict, device: torch.device) -> tuple[SharedWeights, dict]:
    """Map the arena of a handle (``wait_for_export``'s answer) on ``device``; returns it with
    the exporter's ``meta``."""
    rebuild, args = data["reduced"]
    if device.index is None:  # "cuda" means the current device
        device = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(device):
        arena = rebuild(*args)
    if arena.device != device:
        raise PlanError(f"share_weights: the exported arena lives on {arena.device}, this "
                        f"engine runs on {device}")
    entries = tuple(ArenaEntry(e["name"], e["offset"], tuple(e["shape"]), e["dtype"])
                    for e in data["entries"])
    return SharedWeights(arena, entries, owned=False,
                         exporter_device_bytes=int(data["exporter_device_bytes"])), data["meta"]


def claim_loader(path: Path) -> bool:
    """True if this process is the one to load and export (it created ``path.lock``); False if
    another live process holds the claim. A claim whose process is gone is taken over."""
    lock = path.with_name(path.name + ".lock")
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _pid_in(lock)
            if holder is not None and _alive(holder):
                return False
            lock.unlink(missing_ok=True)  # stale: its process died before exporting
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True


def wait_for_export(path: Path, timeout_s: float) -> dict:
    """Wait until the process holding the loader claim has written ``path``; returns the handle.
    A handle left by an earlier exporter (another pid) is not used; fails early, naming it, if
    the claim's process is gone."""
    lock = path.with_name(path.name + ".lock")
    deadline = time.monotonic() + timeout_s
    while True:
        holder = _pid_in(lock)
        if holder is None or not _alive(holder):
            raise PlanError(f"share_weights: the process {holder} that loads and exports the "
                            f"weights for {path} is not running (it exited before exporting, or "
                            "the exporter must outlive the processes that map its weights)")
        data = _read_handle(path)
        if data is not None and data.get("pid") == holder:
            if data.get("version") != HANDLE_VERSION:
                raise PlanError(f"share_weights handle {path} has version "
                                f"{data.get('version')}, this engine reads {HANDLE_VERSION}")
            return data
        if time.monotonic() > deadline:
            raise PlanError(f"share_weights: no weights exported at {path} after {timeout_s:.0f} s"
                            " (share_weights_timeout_s)")
        time.sleep(0.2)


def _read_handle(path: Path) -> dict | None:
    try:
        return pickle.loads(path.read_bytes())  # noqa: S301 - our own file, written by export()
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def _pid_in(lock: Path) -> int | None:
    try:
        return int(lock.read_text().strip() or "0") or None
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class LoadedOrMapped:
    """What ``load_or_map`` hands the engine."""

    config: object  # engine.model_config.ModelConfig
    weights: dict[str, torch.Tensor]
    model_fingerprint: str
    shared: SharedWeights
    non_torch_bytes: int


def load_or_map(ec: object, progress: object = None) -> LoadedOrMapped:  # noqa: C901
    """Load and pack the checkpoint (the first process), or map the arena another process
    exported (the others). ``ec`` is the EngineConfig; ``progress`` a callable or None."""
    say = progress if callable(progress) else (lambda _msg: None)
    device = ec.torch_device
    if device.type != "cuda":
        raise PlanError(f"share_weights needs a CUDA device (the weights are shared through CUDA "
                        f"IPC); this worker runs on {device}: unset share_weights")
    path = Path(ec.share_weights)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info(device)
    seen_bytes = total - free - torch.cuda.memory_reserved(device)
    if claim_loader(path):
        path.unlink(missing_ok=True)  # a previous run's handle points at memory now gone
        if ec.load_format == "dummy":
            return _dummy_arena(ec, device, path, seen_bytes, say)
        say(f"loading weights from {ec.model} (this process exports them: {path})")
        # Host first, then straight into the arena: the device never holds two copies.
        ckpt = load_checkpoint(ec.model, dtype=ec.torch_dtype, device="cpu")
        shared = pack(ckpt.state_dict, device)
        say(f"packed the weights in one {shared.nbytes / 2**20:,.0f} MiB arena to share")
        return LoadedOrMapped(ckpt.config, shared.tensors(), ckpt.model_fingerprint, shared,
                              seen_bytes)
    say(f"waiting for the weights another process loads ({path})")
    handle = wait_for_export(path, ec.share_weights_timeout_s)
    free, total = torch.cuda.mem_get_info(device)
    shared, meta = map_exported(handle, device)
    if meta.get("model") != str(ec.model):
        raise PlanError(f"share_weights: {path} holds the weights of {meta.get('model')!r}, this "
                        f"worker serves {str(ec.model)!r}")
    # What this process sees used on the device, less what the exporter held when it exported
    # (weights + its plan): this process's own CUDA context and libraries.
    non_torch = max(total - free - torch.cuda.memory_reserved(device)
                    - shared.exporter_device_bytes, 0)
    say(f"mapped {shared.nbytes / 2**20:,.0f} MiB of weights exported by another process")
    return LoadedOrMapped(load_model_config(ec.model), shared.tensors(),
                          str(meta["model_fingerprint"]), shared, non_torch)


def _dummy_arena(ec: object, device: torch.device, path: Path, seen_bytes: int,
                 say: object) -> LoadedOrMapped:
    """``load_format=dummy`` in one-box mode: the family's random weights made on the device
    straight into the arena, a layer at a time (laid out from a meta-device pass first)."""
    config = load_model_config(ec.model)
    family = family_class(config)
    layout = dict(family.dummy_tensors(config, ec.torch_dtype, "meta", ec.seed))
    say(f"making dummy weights for {ec.model} on {device} (seed {ec.seed}; this process "
        f"exports them: {path})")
    shared = pack_stream(layout, family.dummy_tensors(config, ec.torch_dtype, device, ec.seed),
                         device)
    say(f"packed the weights in one {shared.nbytes / 2**20:,.0f} MiB arena to share")
    return LoadedOrMapped(config, shared.tensors(), dummy_fingerprint(config, layout, ec.seed),
                          shared, seen_bytes)


def describe(shared: SharedWeights) -> str:
    return json.dumps({"owned": shared.owned, "bytes": shared.nbytes,
                       "tensors": sum(1 for e in shared.entries if "#rows=" not in e.name)})
