"""The memory-bound kernels of a prefill chunk at V4-Flash's shapes, at the tiles given, each
against the default tiles' answer and the copy rate of the bytes it must move: the mHC stream
kernels (``kernels.hc_streams``: mixes, collapse, merge; 4 streams x 4096, 24 mixing rows) and
the FP8 activation quantizer of the prefill projections (``kernels.fp8_w8a8``, at the inputs
1024, 4096 and 8192 wide).

    python -m lab.bench.deepseek_v4.hc_sweep --tokens 4096 \
        --mixes "default;32,64,4,3;16,128,8,3" --collapse "default;1024,4" --merge "default;1024,4" \
        --act-quant "default;64,4;128,8"

Mixes tiles: BLOCK_N,BLOCK_K,warps,stages; collapse and merge: BLOCK_D,warps; act-quant:
rows,warps. On a machine without a GPU it runs each once through the Triton interpreter (a
smoke test, tiny widths).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from lab.bench.deepseek_v4.prefill_gemms import _ms
from lab.bench.results_file import write_json


def _tiles(spec: str) -> tuple[int, ...] | None:
    return None if spec == "default" else tuple(int(t) for t in spec.split(","))


def sweep(tokens: int, dev: str, mixes: list[str], collapse: list[str], merge: list[str],
          act_quant: list[str] | None = None, streams: int = 4, hidden: int = 4096,
          rows: int = 24, quant_widths: tuple[int, ...] = (1024, 4096, 8192)
          ) -> list[dict[str, Any]]:
    """One row per (kernel, tiles): ms, GB/s of the bytes the kernel must move, and the largest
    difference from the default tiles' output (0 where the tiles only regroup the same sums)."""
    from kernels._fp8_w8a8_triton import launch_act_quant
    from kernels._hc_streams_triton import launch_hc_collapse, launch_hc_merge, launch_hc_mixes
    from kernels.fp8_w8a8 import AMAX_FLOOR, GROUP

    g = torch.Generator(device=dev).manual_seed(0)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    s = torch.randn(tokens, streams, hidden, device=dev, generator=g).to(dt)
    fn = torch.randn(rows, streams * hidden, device=dev, generator=g) * 0.01
    pre = torch.rand(tokens, streams, device=dev, generator=g)
    post = torch.rand(tokens, streams, device=dev, generator=g)
    comb = torch.rand(tokens, streams, streams, device=dev, generator=g)
    bo = torch.randn(tokens, hidden, device=dev, generator=g).to(dt)
    esz = s.element_size()
    cases = {
        "mixes": (mixes, lambda t, o: launch_hc_mixes(s, fn, 1e-6, o, t),
                  lambda: torch.empty(tokens, rows, device=dev), s.numel() * esz),
        "collapse": (collapse, lambda t, o: launch_hc_collapse(pre, s, o, t),
                     lambda: torch.empty(tokens, hidden, device=dev, dtype=dt),
                     s.numel() * esz + bo.numel() * esz),
        "merge": (merge, lambda t, o: launch_hc_merge(post, comb, bo, s, o, t),
                  lambda: torch.empty_like(s), 2 * s.numel() * esz + bo.numel() * esz),
    }
    for width in quant_widths if act_quant else ():
        xq = torch.randn(tokens, 1, width, device=dev, generator=g).to(dt)
        codes = torch.empty(tokens, 1, width, device=dev, dtype=torch.uint8)
        cases[f"act_quant {width}"] = (
            act_quant, lambda t, o, xq=xq, codes=codes: launch_act_quant(xq, codes, o, GROUP,
                                                                        AMAX_FLOOR, t),
            lambda width=width: torch.empty(tokens, 1, -(-width // GROUP), device=dev),
            xq.numel() * esz + codes.numel())
    rows_out: list[dict[str, Any]] = []
    for name, (specs, run, make, moved) in cases.items():
        ref = None
        for spec in specs:
            tiles = _tiles(spec)
            out = make()
            try:
                run(tiles, out)
            except Exception as exc:  # noqa: BLE001 (a tile the GPU cannot run: report, go on)
                print(f"[{name}] {spec}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            if ref is None:
                ref = out.clone()
            diff = float((out.float() - ref.float()).abs().max())
            ms = _ms(lambda run=run, tiles=tiles, out=out: run(tiles, out))
            row = {"kernel": name, "tiles": spec, "tokens": tokens, "ms": ms,
                   "gb_per_s": moved / ms / 1e6, "max_diff_vs_first": diff}
            rows_out.append(row)
            print(f"[{name}] {tokens} tokens tiles {spec}: {ms:.4f} ms "
                  f"({row['gb_per_s']:.0f} GB/s of {moved / 2**20:.0f} MiB), "
                  f"max diff {diff:.1e}", flush=True)
    return rows_out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--mixes", default="default")
    p.add_argument("--collapse", default="default")
    p.add_argument("--merge", default="default")
    p.add_argument("--act-quant", default="", help="tiles of the FP8 activation quantizer too")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shape: dict[str, Any] = {} if dev == "cuda" else {"hidden": 64, "rows": 5,
                                                      "quant_widths": (256, 384)}
    tokens = args.tokens if dev == "cuda" else min(args.tokens, 40)
    rows = sweep(tokens, dev, args.mixes.split(";"), args.collapse.split(";"),
                 args.merge.split(";"), [c for c in args.act_quant.split(";") if c], **shape)
    write_json(args.out, {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                          "torch": torch.__version__, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
