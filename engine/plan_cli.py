"""``bulkhead plan``: print the memory plan for a model and limits without loading weights."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from engine.checkpoint import load_model_config
from engine.config import engine_config_from_settings, engine_settings_names
from engine.config_resolve import resolve_engine_config
from engine.errors import EngineError, PlanError
from engine.memory_plan import GiB, MemoryPlan
from engine.memory_planner import make_plan
from engine.model_config import ModelConfig
from engine.models.family import family_class


def _model_config(path: str) -> ModelConfig:
    p = Path(path)
    if p.suffix == ".json":
        return ModelConfig.from_json_file(p)  # named after its folder
    if p.is_dir() and (p / "config.json").exists():
        return ModelConfig.from_json_file(p / "config.json")
    return load_model_config(p)


def _model_label(path: str, mc: ModelConfig) -> str:
    """What the plan is of: the file or folder given (a folder holding config.json by its own
    name, a lone config.json file by its file name, never by the folder it happens to sit in),
    then the checkpoint's own name (``_name_or_path``) or architecture and its family."""
    p = Path(path)
    given = p.name if p.is_dir() or p.name != "config.json" else f"{p.parent.name}/config.json"
    hf = mc.hf_config or {}
    own = hf.get("_name_or_path") or (hf.get("architectures") or [None])[0]
    return f"{given}: {own} ({mc.family})" if own else f"{given} ({mc.family})"


# Worker settings that a plan has no use for (they name no size): left out of the flags.
_NOT_PLANNED = frozenset({"seed", "share_weights_timeout_s", "strict_allocations"})
_PLAN_GIB_DEFAULT = 96.0  # a 96 GB card, when device_memory_gb is 0 and no CUDA device is here


def _unplanned_settings() -> tuple[str, ...]:
    """Worker settings that are not flags of the plan: those that do not size the engine."""
    from common.settings import WorkerSettings

    planned = engine_settings_names(WorkerSettings) - _NOT_PLANNED
    return tuple(f.name for f in dataclasses.fields(WorkerSettings) if f.name not in planned)


def build_parser() -> argparse.ArgumentParser:
    """The workers' own flags (the same loader, names and defaults: a YAML ``--config`` and
    ``BULKHEAD_*`` variables too) for every setting that sizes the engine, and the plan's own:
    ``--role``, ``--weights-gib``, ``--json``."""
    from common import settings_loader
    from common.settings import WorkerSettings

    ap = settings_loader.build_parser(
        WorkerSettings, "bulkhead plan", __doc__ + " The flags are the workers' own, with their "
        "defaults; device auto plans a CUDA device, and device_memory_gb 0 this machine's CUDA "
        f"device or else a {_PLAN_GIB_DEFAULT:g} GiB card.",
        fixed=_unplanned_settings(),
        aliases={"kv_cache_dtype": "--kv-dtype", "device_memory_gb": "--device-memory-gib"})
    ap.add_argument("--role", default="decode", choices=["prefill", "decode"],
                    help="whose section of a --config file to read (default: 'decode')")
    ap.add_argument("--weights-gib", type=float, default=None,
                    help="weight bytes to plan with (default: estimated from the config)")
    ap.add_argument("--json", action="store_true", help="print JSON, one entry per term (default: a table)")
    return ap


def _settings(argv: list[str] | None):  # noqa: ANN202 - WorkerSettings
    from common import settings_loader
    from common.settings import WorkerSettings

    parser = build_parser()
    args = parser.parse_args(argv)
    settings = settings_loader.load(WorkerSettings, parser, argv, None, ("worker", args.role),
                                    "worker", fixed={"role": "decode"})
    if not settings.model:
        raise PlanError("model: give the config.json, checkpoint folder or .gguf file to plan "
                        "(--model; its weights are not read)")
    return settings, args


def main(argv: list[str] | None = None) -> int:
    from common.settings_loader import SettingsError

    argv = sys.argv[1:] if argv is None else argv
    try:
        settings, args = _settings(argv)
        mc = _model_config(settings.model)
        if settings.device == "auto":  # a plan is of a serving card
            settings = dataclasses.replace(settings, device="cuda")
        gib = settings.device_memory_gb or _this_device_gib()
        ec = engine_config_from_settings(settings)
        weights = None if args.weights_gib is None else int(args.weights_gib * GiB)
        tp = ec.tensor_parallel_size
        rank_mc = mc if tp == 1 else family_class(mc).rank_model_config(mc, tp)
        memory = int(gib * GiB)
        ec = resolve_engine_config(ec, mc, lambda c: make_plan(rank_mc, c, memory, weights).fits)
        label = f"planned {gib:g} GiB device" + (f", one of {tp} ranks" if tp > 1 else "")
        plan = make_plan(rank_mc, ec, memory, weights, device_label=label)
    except (EngineError, SettingsError) as e:
        print(f"bulkhead plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": _model_label(settings.model, mc), "family": mc.family,
                          **plan.to_json()}, indent=2))
    else:
        print(f"model {_model_label(settings.model, mc)}, dtype {str(ec.torch_dtype).removeprefix('torch.')}, max_context "
              f"{ec.max_context}, chunk {ec.chunk_tokens}, max_batch {ec.max_batch}, block_size "
              f"{ec.block_size}, kv_dtype {ec.kv_dtype}")
        print(plan.table())
        if ec.tensor_parallel_size > 1:
            print(_per_rank(plan, ec.tensor_parallel_size))
        if not plan.fits:
            print("\nDOES NOT FIT: " + str(_safe_check(plan)))
    return 0 if plan.fits else 1


def _this_device_gib() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GiB
    return _PLAN_GIB_DEFAULT


def _per_rank(plan: MemoryPlan, tp: int) -> str:
    """The figures an operator compares with a peer's start-up log, one rank of ``tp``."""
    return (f"per rank (each of {tp}): weights {plan.term('weights') / GiB:.2f} GiB, KV "
            f"{plan.term('kv_cache') / GiB:.2f} GiB = {plan.kv_tokens:,} tokens, workspace "
            f"{plan.workspace_bytes / GiB:.2f} GiB, activations "
            f"{plan.term('activations') / GiB:.2f} GiB, communication "
            f"{(plan.term('tp.allreduce_staging') + plan.term('tp.nccl_buffers')) / GiB:.2f} GiB")


def _safe_check(plan) -> str:
    try:
        plan.check()
    except EngineError as e:
        return str(e)
    return ""


if __name__ == "__main__":
    sys.exit(main())
