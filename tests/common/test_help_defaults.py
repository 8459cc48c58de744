"""`bulkhead <command> --help` shows every option's default (or says it is required), as vLLM's
does, so nobody has to read the source to learn what they get without a flag."""

from __future__ import annotations

import argparse
import re

import pytest

from bench import load as bench
from common.settings import build_parser as worker_parser
from engine import plan_cli
from launch import up
from launch.launcher import LaunchError
from launch.up_options import worker_limit_flags
from router.settings import build_parser as router_parser

PARSERS = {
    "up": up.build_parser,
    "bench": bench.build_parser,
    "plan": plan_cli.build_parser,
    "router": router_parser,
    "prefill": lambda: worker_parser("prefill"),
    "decode": lambda: worker_parser("decode"),
}


def option_blocks(help_text: str) -> dict[str, str]:
    """Each option's help, joined over its wrapped lines, by its first flag."""
    options = help_text.split("options:", 1)[1]
    blocks: dict[str, str] = {}
    current = ""
    for line in options.splitlines():
        m = re.match(r"^  (-[-\w]+)", line)
        if m:
            current = m.group(1)
            blocks[current] = line
        elif current:
            blocks[current] += " " + line.strip()
    return blocks


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_option_shows_its_default(name: str) -> None:
    parser: argparse.ArgumentParser = PARSERS[name]()
    blocks = option_blocks(parser.format_help())
    assert len(blocks) > 3
    missing = [flag for flag, text in blocks.items()
               if flag not in ("-h", "--help") and not re.search(r"default|required", text)]
    assert not missing, f"bulkhead {name} --help: no default shown for {missing}"


def test_up_limit_flags_reach_the_workers_only_when_given() -> None:
    assert worker_limit_flags(up.build_parser().parse_args([])) == ()
    args = up.build_parser().parse_args(["--max-context", "1024", "--max-batch", "2",
                                         "--chunk-tokens", "256"])
    assert worker_limit_flags(args) == ("--max-context", "1024", "--max-batch", "2",
                                        "--chunk-tokens", "256")
    with pytest.raises(LaunchError, match="--max-batch: -1"):
        worker_limit_flags(up.build_parser().parse_args(["--max-batch", "-1"]))


def test_bench_default_concurrency_does_not_queue_on_default_workers() -> None:
    from common.settings import WorkerSettings

    assert bench.BenchConfig().concurrency <= WorkerSettings().max_batch
