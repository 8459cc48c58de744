"""The prefill GEMMs of one DeepSeek-V4-Flash layer at a 4096-token chunk, previous kernels
against the new ones in the same process:

    python -m lab.bench.deepseek_v4.prefill_gemms --out prefill_gemms.json      # on the GPU
    TRITON_INTERPRET=1 python -m lab.bench.deepseek_v4.prefill_gemms --smoke    # CPU, tiny shapes

FP8 projections (q_a, q_b, kv, the indexer's q_b, the grouped o_a, o_b, the shared expert's
gate/up/down): the weight-only kernel (``kernels.fp8_linear``) against the w8a8 path
(``kernels.fp8_w8a8``: activation quantization + FP8 x FP8 GEMM, both launches timed). The fused
MXFP4 MoE (128 experts, top-6, uniform random routing): the weight-only form and the FP8 form
(``fp8=True``) at the tile choices given by ``--moe-tiles``.
Each row prints ms, TFLOP/s and the relative error against the torch reference. Measurement
only: the engine never imports it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from kernels.fp8_linear import fp8_grouped_linear, fp8_linear
from kernels.fp8_w8a8 import fp8_grouped_linear_w8a8, fp8_linear_w8a8, fp8_w8a8_scratch_bytes
from kernels.fp8_w8a8_ref import fp8_grouped_linear_w8a8_ref, fp8_linear_w8a8_ref
from lab.bench.kernel_quant_cases import _random_fp8, _random_mxfp4, _rel

# name, N (outputs a group), K (inputs a group), groups: one V4-Flash layer's FP8 projections
V4_PROJECTIONS = [("q_a", 1024, 4096, 1), ("q_b", 32768, 1024, 1), ("kv", 512, 4096, 1),
                  ("index_q_b", 8192, 1024, 1), ("o_a", 1024, 4096, 8), ("o_b", 4096, 8192, 1),
                  ("shared_gate", 2048, 4096, 1), ("shared_up", 2048, 4096, 1),
                  ("shared_down", 4096, 2048, 1)]


def _ms(fn: Any) -> float:
    if not torch.cuda.is_available():  # the CPU smoke (interpreter): one call, wall clock
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50))


def bench_projections(m: int, dev: str, shrink: int = 1,
                      tile_choices: list[str] | None = None) -> list[dict[str, Any]]:
    """Every V4-Flash FP8 projection at ``m`` rows (``shrink``: widths divided by it), the
    weight-only kernel against the w8a8 one at its own tiles and at each of ``tile_choices``
    ('BM,BN,GROUP_M,warps,stages')."""
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, n, k, groups in V4_PROJECTIONS:
        n, k = n // shrink, k // shrink
        w, s = _random_fp8(groups * n, k, dev, g)
        x = torch.randn(m, groups, k, device=dev, generator=g).bfloat16()
        out = torch.empty(m, groups * n, device=dev, dtype=torch.bfloat16)
        scratch = torch.empty(fp8_w8a8_scratch_bytes(m, k, groups), dtype=torch.uint8, device=dev)
        if groups > 1:
            old = lambda x=x, w=w, s=s, out=out: fp8_grouped_linear(x, w, s, out)  # noqa: E731
            new = lambda x=x, w=w, s=s, out=out, sc=scratch: fp8_grouped_linear_w8a8(  # noqa: E731
                x, w, s, out, sc)
            ref = fp8_grouped_linear_w8a8_ref(x[:256].float(), w, s)
        else:
            old = lambda x=x[:, 0], w=w, s=s, out=out: fp8_linear(x, w, s, out)  # noqa: E731
            new = lambda x=x[:, 0], w=w, s=s, out=out, sc=scratch: fp8_linear_w8a8(  # noqa: E731
                x, w, s, out, sc)
            ref = fp8_linear_w8a8_ref(x[:256, 0].float(), w, s)
        flop = 2.0 * m * groups * n * k
        row: dict[str, Any] = {"case": name, "m": m, "n": groups * n, "k": k, "groups": groups}
        fns = [("previous", old), ("w8a8", new)]
        for choice in tile_choices or []:
            tiles = tuple(int(t) for t in choice.split(","))
            fn8 = fp8_grouped_linear_w8a8 if groups > 1 else fp8_linear_w8a8
            xx = x if groups > 1 else x[:, 0]
            fns.append((f"w8a8:{choice}", lambda xx=xx, w=w, s=s, out=out, sc=scratch, t=tiles,
                        f=fn8: f(xx, w, s, out, sc, tiles=t)))
        for label, fn in fns:
            fn()
            err = _rel(out[:256], ref)
            ms = _ms(fn)
            row[label] = {"ms": ms, "tflops": flop / ms / 1e9, "rel_err_vs_w8a8_ref": err}
        best = min((k for k in row if k.startswith("w8a8")), key=lambda k: row[k]["ms"])
        row["speedup"] = row["previous"]["ms"] / row["w8a8"]["ms"]
        row["best_w8a8"] = best
        row["best_speedup"] = row["previous"]["ms"] / row[best]["ms"]
        print(f"[fp8] {name:12s} {m} x {groups * n} x {k}: previous {row['previous']['ms']:.3f} ms "
              f"({row['previous']['tflops']:.0f} TFLOP/s), w8a8 {row['w8a8']['ms']:.3f} ms "
              f"({row['w8a8']['tflops']:.0f} TFLOP/s, err {row['w8a8']['rel_err_vs_w8a8_ref']:.1e}) "
              f"x{row['speedup']:.2f}; best {best} x{row['best_speedup']:.2f}", flush=True)
        rows.append(row)
    return rows


def bench_moe(tokens: int, dev: str, variants: list[str],
              shape: tuple[int, int, int, int] = (128, 4096, 2048, 6)) -> list[dict[str, Any]]:
    """The routed experts (experts, hidden, intermediate, top-k = ``shape``) at ``tokens``."""
    from kernels._mxfp4_moe_triton import launch_moe, launch_moe_sort
    from kernels.mxfp4_moe import _carve, _parts, moe_experts, moe_experts_workspace_bytes
    from kernels.mxfp4_moe_ref import moe_experts_ref

    e, hid, inter, top_k = shape
    g = torch.Generator(device=dev).manual_seed(1)
    gu, gus = _random_mxfp4(e, 2 * inter, hid, dev, g)
    dn, dns = _random_mxfp4(e, hid, inter, dev, g)
    x = (torch.randn(tokens, hid, device=dev, generator=g) * 0.1).bfloat16()
    ids = torch.rand(tokens, e, device=dev, generator=g).topk(top_k, dim=1).indices
    tw = torch.rand(tokens, top_k, device=dev, generator=g)
    out = torch.empty(tokens, hid, device=dev, dtype=torch.bfloat16)
    buf = _carve(None, _parts(tokens, top_k, hid, inter, e, x.dtype), torch.device(dev))
    ws8 = torch.empty(moe_experts_workspace_bytes(tokens, top_k, hid, inter, e, x.dtype, True),
                      dtype=torch.uint8, device=dev)
    ref = moe_experts_ref(x[:64], tw[:64], ids[:64], gu, gus, dn, dns, 7.0)
    flop = 2.0 * tokens * top_k * 3 * hid * inter
    rows = []
    for sort, counts in (("all-pairs", None), ("tiled", buf.get("sort_counts"))):
        if sort == "tiled" and counts is None:
            continue
        ms = _ms(lambda counts=counts: launch_moe_sort(ids.view(-1), buf["order"], buf["row_end"],
                                                       e, counts))
        rows.append({"tiles": f"sort:{sort}", "tokens": tokens, "ms": ms})
        print(f"[moe] {tokens} tokens, {sort} sort by expert: {ms:.4f} ms", flush=True)
    for v in variants:
        spec, _, down_spec = v.split(":")[-1].partition("/")  # 'GATE_UP/DOWN' tiles apart
        tiles = tuple(int(t) for t in spec.split(",")) if spec not in ("default", "fp8") else None
        down_tiles = tuple(int(t) for t in down_spec.split(",")) if down_spec else None

        def fn(tiles: Any = tiles, v: str = v, down_tiles: Any = down_tiles) -> None:
            if v.startswith("fp8"):  # the prefill form, its activation quantization included
                moe_experts(x, tw, ids, gu, gus, dn, dns, 7.0, out, workspace=ws8, fp8=True,
                            fp8_tiles=tiles)
                return
            launch_moe(x, ids.view(-1), buf["order"], buf["row_end"], tw.view(-1), gu, gus, dn,
                       dns, 7.0, buf["h"], buf["y"], out, top_k, False, tiles,
                       sort_counts=buf.get("sort_counts"), down_tiles=down_tiles)

        try:
            fn()
            err = _rel(out[:64], ref)
            ms = _ms(fn)
        except Exception as exc:  # a tile choice the compiler refuses (shared memory)
            print(f"[moe] tiles {v}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            rows.append({"tiles": v, "error": str(exc)[:500]})
            continue
        rows.append({"tiles": v, "tokens": tokens, "ms": ms, "tflops": flop / ms / 1e9,
                     "rel_err": err})
        print(f"[moe] {tokens} tokens tiles {v}: {ms:.3f} ms ({flop / ms / 1e9:.0f} TFLOP/s, "
              f"err {err:.1e})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.bench.deepseek_v4.prefill_gemms")
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--out", default="prefill_gemms.json")
    p.add_argument("--moe-tiles", default="fp8;default",
                   help="';'-separated MoE forms: 'default' (weight-only, its own tiles), "
                        "'BM,BN,BK,warps,stages[,swap]' (weight-only; '.../BM,BN,...' gives the "
                        "down GEMM its own), 'fp8' or 'fp8:BM,BN,BK,warps,stages'")
    p.add_argument("--w8a8-tiles", default="",
                   help="';'-separated BM,BN,GROUP_M,warps,stages of the w8a8 GEMM to try too")
    p.add_argument("--smoke", action="store_true",
                   help="CPU under TRITON_INTERPRET=1: 130 rows, widths / 32, 4 small experts")
    args = p.parse_args(argv)
    dev = "cpu" if args.smoke else "cuda"
    rows = 130 if args.smoke else args.rows
    res = {"device": "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name(),
           "torch": torch.__version__,
           "fp8": bench_projections(rows, dev, 32 if args.smoke else 1,
                                    [c for c in args.w8a8_tiles.split(";") if c]),
           "moe": bench_moe(rows, dev, args.moe_tiles.split(";"),
                            (4, 128, 128, 2) if args.smoke else (128, 4096, 2048, 6))}
    prev = sum(r["previous"]["ms"] for r in res["fp8"])
    new = sum(r["w8a8"]["ms"] for r in res["fp8"])
    best = sum(r[r["best_w8a8"]]["ms"] for r in res["fp8"])
    res["fp8_layer_ms"] = {"previous": prev, "w8a8": new, "w8a8_best_tiles": best}
    print(f"[fp8] one layer's projections: previous {prev:.2f} ms, w8a8 {new:.2f} ms "
          f"(best tiles per shape {best:.2f} ms)", flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
