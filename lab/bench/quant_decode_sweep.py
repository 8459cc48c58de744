"""``python -m lab.bench.quant_decode_sweep``: every decode variant of the quantized GEMMs (issue 20)
timed at DeepSeek-V4-Flash's shapes inside CUDA graphs, one JSON line per case, then one
``best`` line per shape saying which variant won and by how much over the default.

FP8 GEMV (``kernels.fp8_linear.Fp8GemvVariant``): the default, the dot form at BLOCK_N 32/64
with split-K, and the no-dot sum form (M = 1) at narrow BLOCK_N with split-K, at M = 1, 8,
32 over N x K = 4096 x 4096, 32768 x 1024 (q_b), 1024 x 4096, 2048 x 4096, 4096 x 8192 (o_b)
and the grouped o_a (8 groups of 1024 rows over 4096 inputs each).
MXFP4 experts (``kernels.mxfp4_moe.moe_experts``): (gate-up, down) split-K x two decode tiles
at 1, 8 and 32 tokens. Each case is checked against its reference (``rel_err``) so a variant
that is fast and wrong shows. ``--smoke``: tiny shapes, runs on the CPU under
TRITON_INTERPRET=1 (times NaN) to prove the sweep runs end to end. Measurement code only: the
engine must never import it.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable

import torch

from kernels.fp8_linear import (
    Fp8GemvVariant,
    fp8_gemv_variant,
    fp8_grouped_linear,
    fp8_linear,
    fp8_linear_scratch_bytes,
    gemv_num_splits,
)
from kernels.fp8_linear_ref import fp8_grouped_linear_ref
from kernels.mxfp4_moe import moe_experts, moe_experts_workspace_bytes
from kernels.mxfp4_moe_ref import moe_experts_ref
from lab.bench.kernel_quant_cases import _random_fp8, _random_mxfp4, _rel, graph_ms
from lab.bench.results_file import write_json

Timer = Callable[[Callable[[], object], int], float]

# (outputs over all groups, inputs per group, groups)
FP8_SHAPES = ((4096, 4096, 1), (32768, 1024, 1), (1024, 4096, 1), (2048, 4096, 1),
              (4096, 8192, 1), (8192, 4096, 8))
FP8_ROWS = (1, 8, 32)
MOE_TOKENS = (1, 8, 32)
MOE_SHAPE = (128, 4096, 2048, 6)  # experts, hidden, intermediate, top-k
# the tiled decode form at two widths, then the per-pair GEMV form (BLOCK_M 1): its 6th element
# 1 reads the weights as int32 words, 0 as bytes (the earlier decode); 2 warps, words: the default.
# A tiled form's 8th element 1: int32 words decoded straight to bf16
MOE_TILES = ((16, 64, 128, 4, 3), (16, 32, 128, 4, 3), (16, 64, 128, 4, 3, 1, 0, 1),
             (1, 16, 256, 4, 3, 0),
             (1, 16, 256, 2, 3, 0), (1, 16, 256, 4, 3, 1), (1, 16, 256, 2, 3, 1),
             (1, 32, 256, 4, 3, 1), (1, 32, 256, 2, 3, 1), (1, 16, 128, 2, 3, 1),
             (1, 16, 256, 1, 3, 1))


def fp8_variants(m: int, n: int, k: int, splits: tuple[int, ...],
                 sum_bns: tuple[int, ...]) -> list[tuple[str, Fp8GemvVariant]]:
    """(label, variant) to time at m x n over k: the default first."""
    default = fp8_gemv_variant(m, n, k, 128)
    assert default is not None
    out = [("default", default)]
    bm = default.tiles[0]
    for bn in (32, 64):
        for split in splits:
            v = Fp8GemvVariant((bm, bn, 128, 2 if bn == 32 else 1, 4, 3), split, "dot")
            if v != default:
                out.append((f"dot bn{bn} split{split}", v))
    if m == 1:  # the sum form re-reads the weight a row: meant for one
        for bn in sum_bns:
            for split in splits:
                warps = 1 if bn <= 4 else 2 if bn <= 8 else 4
                out.append((f"sum bn{bn} split{split}",
                            Fp8GemvVariant((1, bn, 128, 2, warps, 3), split, "sum")))
    return out


def sweep_fp8(timer: Timer, dev: str, shapes: tuple[tuple[int, int, int], ...],
              rows: tuple[int, ...], splits: tuple[int, ...], sum_bns: tuple[int, ...],
              copy_tb_s: float) -> list[dict]:
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    out: list[dict] = []
    for n, k, groups in shapes:
        q, s = _random_fp8(n, k, dev, g)
        wbytes = q.numel() + s.numel() * 4
        for m in rows:
            x = torch.randn(m, groups, k, device=dev, generator=g).to(dt)
            y = torch.empty(m, n, device=dev, dtype=dt)
            ref = fp8_grouped_linear_ref(x.float(), q, s)
            cases = fp8_variants(m, n, k, splits, sum_bns)
            ws = torch.empty(max(fp8_linear_scratch_bytes(m, n, k, variant=v) for _, v in cases)
                             + 256, dtype=torch.uint8, device=dev)
            for label, v in cases:
                if groups > 1:
                    def fn(x=x, y=y, q=q, s=s, v=v, ws=ws) -> object:
                        return fp8_grouped_linear(x, q, s, y, workspace=ws, gemv=v)
                else:
                    def fn(x=x, y=y, q=q, s=s, v=v, ws=ws) -> object:
                        return fp8_linear(x[:, 0], q, s, y, workspace=ws, gemv=v)
                y.fill_(float("nan"))
                fn()
                err = _rel(y, ref)
                ms = timer(fn, 20)
                row = {"case": "fp8_gemv", "variant": label, "m": m, "n": n, "k": k,
                       "groups": groups, "tiles": list(v.tiles), "split": v.split,
                       "slices": gemv_num_splits(k, v.tiles[2], v.split), "form": v.form,
                       "ms": ms, "gb_s": wbytes / (ms * 1e6),
                       "pct_of_copy": 100 * wbytes / (ms * 1e9 * copy_tb_s), "rel_err": err}
                out.append(row)
                print(json.dumps(row), flush=True)
    return out


def sweep_moe(timer: Timer, dev: str, shape: tuple[int, int, int, int], tokens: tuple[int, ...],
              splits: tuple[tuple[int, int], ...], tiles: tuple[tuple[int, ...], ...],
              copy_tb_s: float) -> list[dict]:
    dt = torch.bfloat16
    e, hid, inter, top_k = shape
    g = torch.Generator(device=dev).manual_seed(1)
    gu, gus = _random_mxfp4(e, 2 * inter, hid, dev, g)
    dn, dns = _random_mxfp4(e, hid, inter, dev, g)
    expert_bytes = gu[0].numel() + gus[0].numel() + dn[0].numel() + dns[0].numel()
    out: list[dict] = []
    for t in tokens:
        x = torch.randn(t, hid, device=dev, generator=g).to(dt)
        ids = torch.stack([torch.randperm(e, device=dev, generator=g)[:top_k] for _ in range(t)])
        w = torch.rand(t, top_k, device=dev, generator=g)
        y = torch.empty(t, hid, device=dev, dtype=dt)
        ref = moe_experts_ref(x.float(), w, ids, gu, gus, dn, dns, 10.0)
        wbytes = int(ids.unique().numel()) * expert_bytes
        ws = torch.empty(max(moe_experts_workspace_bytes(t, top_k, hid, inter, e, dt, splits=sp)
                             for sp in (*splits, None)), dtype=torch.uint8, device=dev)
        variants: list[tuple[str, tuple[int, ...] | None, tuple[int, int] | None]] = [
            ("default", None, None)]
        variants += [(f"{'gemv' if tl_[0] == 1 else 'tiled'} bn{tl_[1]} bk{tl_[2]} w{tl_[3]}"
                      f"{' words' if (tl_[5:6] if tl_[0] == 1 else tl_[7:8]) == (1,) else ''} "
                      f"split{sp[0]}x{sp[1]}", tl_, sp) for tl_ in tiles for sp in splits]
        for label, tl_, sp in variants:
            def fn(x=x, w=w, ids=ids, y=y, sp=sp, tl_=tl_, ws=ws) -> object:
                return moe_experts(x, w, ids, gu, gus, dn, dns, 10.0, y, workspace=ws,
                                   splits=sp, tiles=tl_)
            y.fill_(float("nan"))
            fn()
            err = _rel(y, ref)
            ms = timer(fn, 20)
            row = {"case": "mxfp4_moe", "variant": label, "tokens": t,
                   "tiles": None if tl_ is None else list(tl_),
                   "splits": None if sp is None else list(sp), "ms": ms,
                   "gb_s": wbytes / (ms * 1e6),
                   "pct_of_copy": 100 * wbytes / (ms * 1e9 * copy_tb_s), "rel_err": err}
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def best_rows(rows: list[dict]) -> list[dict]:
    """Per shape: the fastest variant whose error is that of the default's order, against
    the default."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["case"], r.get("m"), r.get("n"), r.get("k"), r.get("groups"), r.get("tokens"))
        groups.setdefault(key, []).append(r)
    out = []
    for rs in groups.values():
        base = next(r for r in rs if r["variant"] == "default")
        ok = [r for r in rs if r["rel_err"] <= max(2 * base["rel_err"], 1e-2)]  # NaN: out
        timed = [r for r in ok if not math.isnan(r["ms"])]
        best = min(timed, key=lambda r: r["ms"]) if timed else base
        keep = {k: v for k, v in base.items() if k in ("case", "m", "n", "k", "groups", "tokens")}
        out.append({**keep, "best": best["variant"], "best_ms": best["ms"],
                    "default_ms": base["ms"], "speedup": base["ms"] / best["ms"],
                    "best_gb_s": best["gb_s"]})
    return out


def _run_once(fn: Callable[[], object], rep_ms: int) -> float:
    """The smoke timer: runs ``fn`` (the interpreter is far too slow to time) -> NaN."""
    fn()
    return float("nan")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def _pairs(text: str) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in (p.split("x") for p in text.split(",") if p))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--fp8-split", default="1,2,4,8", help="K slices of the FP8 GEMV")
    parser.add_argument("--fp8-sum-bn", default="4,8,16", help="BLOCK_N of the no-dot form")
    parser.add_argument("--moe-split", default="1x1,2x1,4x1,2x2,4x2",
                        help="gate-up x down split-K of the experts")
    parser.add_argument("--only", default="fp8,moe")
    parser.add_argument("--copy-tb-s", type=float, default=4.1, help="the copy rate for pct_of_copy")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; CPU interpreter")
    parser.add_argument("--json", help="also write every row here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    on_gpu = torch.cuda.is_available()
    dev = "cuda" if on_gpu else "cpu"
    timer: Timer = graph_ms if on_gpu else _run_once
    rows: list[dict] = []
    fp8_shapes, fp8_rows, moe_shape, moe_tokens = FP8_SHAPES, FP8_ROWS, MOE_SHAPE, MOE_TOKENS
    moe_tiles = MOE_TILES
    if args.smoke:
        fp8_shapes, fp8_rows = ((72, 300, 1), (48, 260, 2)), (1, 3, 17)
        moe_shape, moe_tokens = (6, 160, 96, 2), (1, 3)
        moe_tiles = ((16, 32, 64, 4, 1), (1, 32, 64, 4, 1))  # tiled and per-pair forms
    if "fp8" in args.only:
        rows += sweep_fp8(timer, dev, fp8_shapes, fp8_rows, _ints(args.fp8_split),
                          _ints(args.fp8_sum_bn), args.copy_tb_s)
    if "moe" in args.only:
        rows += sweep_moe(timer, dev, moe_shape, moe_tokens, _pairs(args.moe_split), moe_tiles,
                          args.copy_tb_s)
    best = best_rows(rows)
    for r in best:
        print(json.dumps({"case": "best", **r}), flush=True)
    print(json.dumps({"case": "done", "rows": len(rows), "wall_s": time.perf_counter() - start}),
          flush=True)
    write_json(args.json, {"rows": rows, "best": best})
    return rows


if __name__ == "__main__":
    main()
