"""``python -m lab.bench.kernels``: the kernels' figures on a CUDA GPU, printed as markdown tables.

Measures (a) the device's own ceilings (copy bandwidth, bf16 matmul rate), (b) the indexer at
S=4096, H=64, D=128, top-512 over T = context/4 keys: peak memory above the inputs, time vs the
FLOP limit, indices vs the reference (bf16 and FP8), and the transformers-style naive version,
(c) DeepSeek-V4 sparse attention, (d) dense paged attention (prefill, decode) and (e, with
``--only quant``) the FP8 linear and MXFP4 experts vs FLOP / bandwidth limits, each checked
against its reference. ``--smoke`` runs every path at toy sizes (on CPU through the Triton
interpreter when there is no GPU) so the script is known to work before GPU time is spent. For measurement only: the engine must never import it; it allocates
freely.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial

import torch

from kernels.indexer_topk import IndexerTiles
from lab.bench.kernel_cases import (
    BenchShapes,
    bench_indexer,
    bench_indexer_split,
    bench_paged,
    bench_sparse,
    sweep_indexer_tiles,
)
from lab.bench.results_file import write_json

GIB = 1024**3


@dataclass(frozen=True)
class Ceilings:
    copy_tb_s: float
    matmul_tflops: float


def bench_ms(fn: Callable[[], object], rep_ms: int = 200) -> float:
    """Median milliseconds of ``fn`` (CUDA events via do_bench; one wall-clock run on CPU)."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def measure_ceilings() -> Ceilings:
    if not torch.cuda.is_available():
        return Ceilings(copy_tb_s=float("nan"), matmul_tflops=float("nan"))
    src = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(partial(dst.copy_, src), 100)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = bench_ms(partial(torch.matmul, a, b), 200)
    return Ceilings(copy_tb_s=2 * 2 * GIB / ms / 1e9, matmul_tflops=2 * 8192**3 / mm / 1e9)


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def print_table(title: str, rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(f"\n### {title}\n")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(_fmt(r.get(k)) for k in keys) + " |")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--only", choices=["indexer", "sparse", "paged", "sweep", "quant"], action="append")
    ap.add_argument("--contexts", type=int, nargs="*", default=None)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-naive", action="store_true")
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="toy sizes; CPU interpreter if no GPU")
    for name in ("tile-w", "block-m", "block-n", "num-warps", "num-stages"):
        ap.add_argument(f"--{name}", type=int, default=None, help="indexer tile override")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        if not args.smoke:
            raise SystemExit("lab.bench.kernels needs a CUDA device (or --smoke)")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    shapes = BenchShapes.smoke() if args.smoke else BenchShapes()
    if args.contexts:
        shapes = replace(shapes, contexts=tuple(args.contexts))
    only = set(args.only or ["indexer", "sparse", "paged"])
    overrides = {k: getattr(args, k) for k in ("tile_w", "block_m", "block_n", "num_warps",
                                                 "num_stages") if getattr(args, k) is not None}
    tiles = replace(shapes.tiles, **overrides)
    import triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
                    "torch": torch.__version__, "triton": triton.__version__,
                    "tiles": asdict(tiles)}
    ceil = measure_ceilings()
    report["ceilings"] = asdict(ceil)
    print(json.dumps(report), flush=True)
    check = not args.no_check
    if "sweep" in only:
        report["sweep"] = sweep_indexer_tiles(shapes, bench_ms)
        ok = [r for r in report["sweep"] if "ms" in r]
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            tiles = IndexerTiles(**{k: best[k] for k in asdict(tiles)})
            report["tiles"] = asdict(tiles)
        report["split"] = bench_indexer_split(shapes, tiles, bench_ms)
        print(json.dumps(report["split"]), flush=True)
    if "indexer" in only:
        report["indexer"] = bench_indexer(shapes, tiles, bench_ms, check, not args.no_naive,
                                          not args.no_fp8)
    if "sparse" in only:
        report["sparse"] = bench_sparse(shapes, bench_ms, check, ceil.copy_tb_s)
    if "paged" in only:
        report["paged"] = bench_paged(shapes, bench_ms, check, ceil.copy_tb_s)
    if "quant" in only:
        from lab.bench.kernel_quant_cases import bench_quant

        report["quant"] = bench_quant(bench_ms, ceil.copy_tb_s, args.smoke, check)
    print(f"\n{report['device']}, torch {report['torch']}, triton {report['triton']}; "
          f"copy {ceil.copy_tb_s:.2f} TB/s, bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s")
    for key in ("sweep", "indexer", "sparse", "paged", "quant"):
        print_table(key, report.get(key, []))
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
