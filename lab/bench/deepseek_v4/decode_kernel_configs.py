"""The small kernels of a V4 decode step at each launch setting given (``kernels._launch_configs``),
at V4-Flash's shapes, timed from a CUDA graph (20 calls back to back, as a captured step makes
them) and checked against the default setting's outputs:

* ``moe_route``: the routing of ``--experts`` experts, top-6, sqrt-softplus with a bias (and
  the router's linear then the routing, two launches, the unfused form).
* ``moe_router``: the router's linear (4096 wide) and the routing in one launch.
* ``compress``: ``kernels.compress_decode`` (window + entry launches) of the HCA compressor
  (rate 128, 512 channels), the CSA one (rate 4, overlapping, 512) and the indexer's (rate 4,
  overlapping, 128); the window settings and the entry's warps are swept together.
* ``rope_norm``: q's norm + RoPE (64 x 512), q_a's weighted norm (1024), the shared KV's norm +
  RoPE into the window ring (512, remapped rows), the indexer queries' RoPE (64 x 128).
* ``topk_merge``: the decode indexer's top-512 over ``--context`` tokens of entries (rate 4),
  the merge's warps, with the merge on 1, 4, 8 and the default number of programs a row.

    python -m lab.bench.deepseek_v4.decode_kernel_configs --batches 1,8,32 [--kernels moe_route,compress]

Settings: ``KERNEL=...`` lists separated by ";", each a comma list of the kernel's knobs in
``KNOBS`` order ("default" for the defaults); compress takes window C,W,warps then the entry's
warps. Without a GPU each setting runs once through the Triton interpreter on tiny shapes (a
smoke test: the outputs must agree).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from kernels._launch_configs import KNOBS, overridden
from lab.bench.deepseek_v4.hc_decode_warps import _graph_us
from lab.bench.results_file import write_json

SWEEPS = {
    "moe_route": "default;1;2;8",
    "moe_router": "default;8,512,4;2,512,4;4,1024,4;4,256,2;8,1024,8;2,1024,1;2,256,1",
    "compress": "default;32,32,4,4;16,32,4,4;32,128,4,4;16,128,2,4;32,128,2,2;16,128,1,1;"
                "64,128,4,2;16,64,2,2",
    "rope_norm": "default;1;2;8",
    "topk_merge": "default;2;8;16",
}
_SETTINGS = {  # the kernels a sweep's setting overrides, in order of its numbers
    "moe_route": (("moe_route", KNOBS["moe_route"]),),
    "moe_router": (("moe_router", KNOBS["moe_router"]),),
    "compress": (("compress_window", KNOBS["compress_window"]),
                 ("compress_entry", KNOBS["compress_entry"])),
    "rope_norm": (("rope_norm", KNOBS["rope_norm"]),),
    "topk_merge": (("topk_merge", KNOBS["topk_merge"]),),
}


def parse_setting(sweep: str, spec: str) -> dict[str, dict[str, int]]:
    """'16,128,2,4' -> {"compress_window": {...}, "compress_entry": {...}}; 'default' -> {}."""
    spec = spec.strip()
    if spec == "default":
        return {}
    values = [int(v) for v in spec.split(",")]
    names = [(k, knob) for k, knobs in _SETTINGS[sweep] for knob in knobs]
    if len(values) != len(names):
        raise ValueError(f"{sweep} settings are {len(names)} numbers "
                         f"({', '.join(f'{k}.{n}' for k, n in names)}), got {spec!r}")
    out: dict[str, dict[str, int]] = {}
    for (kernel, knob), v in zip(names, values, strict=True):
        out.setdefault(kernel, {})[knob] = v
    return out


@contextmanager
def _applied(setting: dict[str, dict[str, int]]) -> Iterator[None]:
    with ExitStack() as stack:
        for kernel, knobs in setting.items():
            stack.enter_context(overridden(kernel, **knobs))
        yield


def _cases(sweep: str, n: int, dev: str, tiny: bool, experts: int, context: int
           ) -> list[tuple[str, Callable[[], None], Callable[[], list[torch.Tensor]],
                           Callable[[], None]]]:
    """(name, call, outputs, reset) of each shape ``sweep`` times at ``n`` rows; ``reset`` puts
    back the state a call updates in place (the compressors' windows), so every setting's
    outputs come from the same inputs."""
    g = torch.Generator(device=dev).manual_seed(n)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    f32 = dict(device=dev, dtype=torch.float32)

    def randn(*shape, dtype=dt):
        return torch.randn(*shape, device=dev, generator=g).to(dtype)

    cases: list = []

    def nothing() -> None:
        return None

    if sweep == "moe_route":
        from kernels.moe_decode import moe_route

        e = 16 if tiny else experts
        logits, bias = randn(n, e), randn(e, dtype=torch.float32) * 0.1
        w, idx = torch.empty(n, 6, **f32), torch.empty(n, 6, device=dev, dtype=torch.long)
        cases.append((f"route {e} experts", lambda: moe_route(
            logits, 6, "sqrtsoftplus", 1.5, weights=w, experts=idx, bias=bias),
            lambda: [w.clone(), idx.clone()], nothing))
        # the unfused router as the decode step ran it before moe_router: linear, then route
        x, gw = randn(n, 32 if tiny else 4096), randn(e, 32 if tiny else 4096) * 0.02
        cases.append((f"linear + route {e} experts", lambda: moe_route(
            torch.nn.functional.linear(x, gw), 6, "sqrtsoftplus", 1.5, weights=w, experts=idx,
            bias=bias), lambda: [w.clone(), idx.clone()], nothing))
    elif sweep == "moe_router":
        from kernels.moe_decode import moe_router

        e, hidden = (16, 40) if tiny else (experts, 4096)
        x, gw = randn(n, hidden), randn(e, hidden) * 0.02
        bias = randn(e, dtype=torch.float32) * 0.1
        w, idx = torch.empty(n, 6, **f32), torch.empty(n, 6, device=dev, dtype=torch.long)
        lg = torch.empty(n, e, device=dev, dtype=dt)
        sem = torch.zeros(max(n, 1), device=dev, dtype=torch.int32)
        cases.append((f"linear + route {e} experts, fused", lambda: moe_router(
            x, gw, 6, "sqrtsoftplus", 1.5, weights=w, experts=idx, logits=lg, semaphores=sem,
            bias=bias), lambda: [w.clone(), idx.clone(), lg.clone()], nothing))
    elif sweep == "compress":
        from kernels.compress_decode import compress_decode

        bs = 256
        shapes = ((("HCA", 8, 24, False), ("CSA", 4, 20, True)) if tiny else
                  (("HCA", 128, 512, False), ("CSA", 4, 512, True), ("indexer", 4, 128, True)))
        for name, r, d, ov in shapes:
            width = 2 * d if ov else d
            blocks = 8
            tables = (torch.arange(n * blocks, device=dev).view(n, blocks) + 1)
            # positions in the table's reach; every row a window's last token half the time
            pos = torch.randint(0, blocks * bs // 2, (n,), device=dev, generator=g)
            pos = torch.where(torch.arange(n, device=dev) % 2 == 0, pos // r * r + r - 1, pos)
            rows = torch.arange(n, device=dev)
            st = dict(buf_kv=randn(n, r, width), buf_gate=randn(n, r, width))
            if ov:
                st |= dict(ov_kv=randn(n * blocks + 1, r, d),
                           ov_gate=randn(n * blocks + 1, r, d, dtype=torch.float32))
            prm = dict(position_bias=randn(r, width, dtype=torch.float32) * 0.5,
                       norm_weight=1 + 0.1 * randn(d, dtype=torch.float32), eps=1e-6,
                       inv_freq=1.0 / 100 ** (torch.arange(d // 16, **f32) / (d // 16)),
                       rope_scale=1.0)
            kv, gate = randn(n, width), randn(n, width)
            out, ent = torch.empty(n, d, device=dev, dtype=dt), torch.empty(n, d, device=dev, dtype=dt)
            dst = torch.empty(n, device=dev, dtype=torch.long)

            def call(kv=kv, gate=gate, rows=rows, pos=pos, tables=tables, st=st, prm=prm,
                     out=out, ent=ent, dst=dst):
                compress_decode(kv, gate, rows, rows, pos, tables, **st, **prm, block_size=bs,
                                ent=ent, out=out, dst=dst)

            saved = {k: v.clone() for k, v in st.items()}

            def reset(st=st, saved=saved):
                for k, v in st.items():
                    v.copy_(saved[k])

            cases.append((f"compress {name} r{r} d{d}", call,
                          lambda out=out, dst=dst, st=st: [out.clone(), dst.clone(),
                                                           *(v.clone() for v in st.values())],
                          reset))
    elif sweep == "rope_norm":
        from kernels.rope_norm import rope_norm

        h, d, dq, di = (2, 32, 48, 16) if tiny else (64, 512, 1024, 128)
        half = 8 if tiny else 32
        cos, sin = randn(n, half), randn(n, half)
        q, qa, kv, iq = randn(n, h, d), randn(n, dq), randn(n, d), randn(n, h, di)
        ring = torch.zeros(4 * n, d, device=dev, dtype=dt)
        dst_rows = torch.arange(n, device=dev) * 4 + 1
        outs = dict(q=torch.empty_like(q), qa=torch.empty_like(qa), iq=torch.empty_like(iq))
        wq, wkv = 1 + randn(dq, dtype=torch.float32) * 0.1, 1 + randn(d, dtype=torch.float32) * 0.1
        empty = qa.new_empty(n, 0)
        cases += [
            (f"q norm+rope {h}x{d}", lambda: rope_norm(q, cos, sin, outs["q"], norm=True),
             lambda: [outs["q"].clone()], nothing),
            (f"q_a norm {dq}", lambda: rope_norm(qa, empty, empty, outs["qa"], norm=True,
                                                  weight=wq), lambda: [outs["qa"].clone()], nothing),
            (f"kv norm+rope {d} -> ring", lambda: rope_norm(
                kv, cos, sin, ring, norm=True, weight=wkv, dst_rows=dst_rows),
             lambda: [ring.clone()], nothing),
            (f"index q rope {h}x{di}", lambda: rope_norm(iq, cos, sin, outs["iq"], norm=False),
             lambda: [outs["iq"].clone()], nothing),
        ]
    elif sweep == "topk_merge":
        from kernels.indexer_decode import (
            indexer_decode_topk,
            indexer_decode_topk_workspace_bytes,
            merge_parts,
        )

        h, di, per, topk = (2, 16, 4, 8) if tiny else (64, 128, 64, 512)
        entries = 64 if tiny else context // 4
        blocks = -(-entries // per)
        tile = 32 if tiny else 32768
        q, w = randn(n, h, di), randn(n, h, dtype=torch.float32)
        keys = randn(n * blocks * per, di)
        tables = torch.randperm(n * blocks, device=dev, generator=g).view(n, blocks)
        kv_end = torch.full((n,), entries, device=dev, dtype=torch.long) - torch.arange(n, device=dev)
        out = torch.empty(n, topk, device=dev, dtype=torch.int32)
        for parts in dict.fromkeys((1, 4, 8, merge_parts(min(tile, entries)))):
            ws = torch.empty(indexer_decode_topk_workspace_bytes(n, topk, tile, parts),
                             device=dev, dtype=torch.uint8)
            cases.append((f"indexer top-{topk} of {entries}, {parts} parts",
                          lambda ws=ws, parts=parts: indexer_decode_topk(
                              q, w, keys, tables, kv_end, per, topk, tile, out, workspace=ws,
                              parts=parts), lambda: [out.clone()], nothing))
    else:
        raise ValueError(f"unknown sweep {sweep!r} (one of {sorted(SWEEPS)})")
    return cases


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x.double() - y.double()).abs().max().item() if x.numel() else 0.0)
               for x, y in zip(a, b, strict=True))


def sweep(sweeps: dict[str, list[str]], batches: list[int], dev: str, experts: int = 128,
          context: int = 131072) -> list[dict[str, Any]]:
    tiny = dev != "cuda"
    rows = []
    for name, specs in sweeps.items():
        settings = [(s, parse_setting(name, s)) for s in ["default", *specs] if s]
        settings = list(dict((s, v) for s, v in settings).items())
        for n in batches:
            for case, call, outputs, reset in _cases(name, n, dev, tiny, experts, context):
                ref = None
                for spec, setting in settings:
                    with _applied(setting):
                        reset()
                        call()
                        got = outputs()
                        us = _graph_us(call) if dev == "cuda" else float("nan")
                    diff = 0.0 if ref is None else _max_diff(got, ref)
                    ref = ref if ref is not None else got
                    rows.append(dict(sweep=name, case=case, batch=n, setting=spec,
                                     launch=setting, us=us, max_diff=diff))
                    print(f"[{name}] {case:34s} batch {n:3d} {spec:16s}: {us:7.2f} us  "
                          f"max diff {diff:.1e}", flush=True)
    return rows


def best_env(rows: list[dict[str, Any]], batch: int) -> str:
    """The ``BULKHEAD_LAUNCH`` value of each sweep's fastest setting at ``batch`` (its cases'
    microseconds summed), only where that is not the default. (A row's ``launch`` is what its
    setting overrides; the defaults may differ by shape: ``kernels._launch_configs``.)"""
    items = []
    for name in dict.fromkeys(r["sweep"] for r in rows):
        total: dict[str, float] = {}
        launch: dict[str, dict] = {}
        for r in rows:
            if r["sweep"] == name and r["batch"] == batch:
                total[r["setting"]] = total.get(r["setting"], 0.0) + r["us"]
                launch[r["setting"]] = r["launch"]
        if "default" not in total:
            continue
        best = min(total, key=lambda k: total[k])
        if total[best] >= total["default"]:
            continue
        for kernel, knobs in launch[best].items():
            items.append(f"{kernel}:" + ",".join(f"{k}={v}" for k, v in knobs.items()))
    return ";".join(items)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.bench.deepseek_v4.decode_kernel_configs",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--kernels", default=",".join(SWEEPS),
                   help=f"sweeps to run (of {', '.join(SWEEPS)})")
    p.add_argument("--settings", action="append", default=[], metavar="SWEEP=S1;S2",
                   help="settings of one sweep instead of its list (repeatable)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--context", type=int, default=131072, help="tokens the indexer's top-k spans")
    p.add_argument("--out", default="")
    p.add_argument("--best", metavar="JSON", default="",
                   help="print the BULKHEAD_LAUNCH value of the fastest settings in an earlier "
                        "run's --out (at --best-batch) and exit")
    p.add_argument("--best-batch", type=int, default=1)
    a = p.parse_args(argv)
    if a.best:
        with open(a.best) as f:
            print(best_env(json.load(f), a.best_batch))
        return 0
    names = [k.strip() for k in a.kernels.split(",") if k.strip()]
    specs = {k: SWEEPS[k] for k in names if k in SWEEPS}
    if len(specs) != len(names):
        p.error(f"--kernels: unknown sweep in {names} (known: {', '.join(SWEEPS)})")
    for item in a.settings:
        k, _, v = item.partition("=")
        if k not in specs:
            p.error(f"--settings: {k!r} is not a sweep being run ({', '.join(specs)})")
        specs[k] = v
    chosen = {k: v.split(";") for k, v in specs.items()}
    try:
        for k, v in chosen.items():
            for s in v:
                if s.strip():
                    for kernel, knobs in parse_setting(k, s).items():
                        with overridden(kernel, **knobs):
                            pass
    except ValueError as exc:
        p.error(str(exc))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    batches = [int(b) for b in a.batches.split(",")] if dev == "cuda" else [1, 3]
    rows = sweep(chosen, batches, dev, a.experts, a.context)
    write_json(a.out, rows)
    bad = [r for r in rows if r["max_diff"] > (0.0 if r["sweep"] in ("moe_route", "topk_merge")
                                               else 0.05)]
    # (moe_router: its logits' sums run in another order for each setting; a one-ulp change
    # of a near tie's logit may swap an expert, which reads as a difference of a whole index)
    for r in bad:
        print(f"[configs] MISMATCH {r['sweep']} {r['case']} batch {r['batch']} {r['setting']}: "
              f"max diff {r['max_diff']:.3g}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
