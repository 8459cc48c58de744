"""The ``bulkhead`` command: one entry point, one subcommand per component.

    bulkhead up       router + prefill + decode (+ KV store) on this host   (launch.up)
    bulkhead router   the OpenAI-compatible gateway                         (router.server)
    bulkhead prefill  a prefill worker                                      (prefill_worker.server)
    bulkhead decode   a decode worker                                       (decode_worker.server)
    bulkhead plan     print the memory plan for a model and limits          (engine.plan_cli)
    bulkhead bench    load generator for any OpenAI endpoint                (bench.load)
    bulkhead bench split OUT   one-box split vs colocated under long prompts (bench.split)
    bulkhead export-tokenizer DIR   a model's tokenizer as an HF folder   (launch.export_tokenizer)

Each subcommand's module is imported only when that subcommand runs, so ``bulkhead router`` and
``bulkhead up`` never import torch. This module holds no state and parses nothing but the
subcommand name; each component owns its flags (``bulkhead <cmd> --help``).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

from common.worker_env import WORKER_ENV

# subcommand -> (module, one-line description)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("launch.up", "start router + prefill + decode workers (+ KV store) on this host"),
    "router": ("router.server", "run the OpenAI-compatible router"),
    "prefill": ("prefill_worker.server", "run a prefill worker (gRPC)"),
    "decode": ("decode_worker.server", "run a decode worker (gRPC)"),
    "plan": ("engine.plan_cli", "print the memory plan for a model and limits"),
    "bench": ("bench.load", "load-test an OpenAI-compatible endpoint ('bench split': the "
                           "one-box split against a colocated worker)"),
    "export-tokenizer": ("launch.export_tokenizer", "write a model's tokenizer as an HF folder"),
}



def _reexec_with_worker_env(args: list[str]) -> None:
    """`bulkhead prefill|decode` from a shell without PYTHONHASHSEED: restart the interpreter
    with it (same pid), so every way of starting a worker hashes alike."""
    if "PYTHONHASHSEED" in os.environ:
        return
    env = {**os.environ, **{k: v for k, v in WORKER_ENV.items() if k not in os.environ}}
    os.execve(sys.executable, [sys.executable, "-m", "launch.cli", *args], env)


def usage() -> str:
    lines = ["usage: bulkhead <command> [options]", "", "commands:"]
    lines += [f"  {name:16s} {desc}" for name, (_, desc) in SUBCOMMANDS.items()]
    lines += ["", "`bulkhead <command> --help` lists a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"bulkhead: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if argv is None and name in ("prefill", "decode"):
        _reexec_with_worker_env(args)
    module = importlib.import_module(SUBCOMMANDS[name][0])
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
