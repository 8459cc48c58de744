"""kernels.compress_decode against kernels.compress_decode_ref over consecutive decode steps
(windows filling and closing, CSA's overlap carried across blocks and within one), on awkward
shapes: rates 1..8, dims not multiples of the kernel's slices, a rope as wide as the entry,
rows at different positions, a pad row sharing row 0's slot. CPU tier through the Triton
interpreter; gpu tier in bf16 at V4-Flash's widths."""

from __future__ import annotations

import pytest
import torch

from kernels.compress_decode import compress_decode
from kernels.compress_decode_ref import compress_decode_ref
from kernels.errors import KernelArgumentError


def _state(rows: int, r: int, d: int, overlap: bool, blocks: int, dtype, device, g):
    width = 2 * d if overlap else d
    st = dict(buf_kv=torch.randn(rows, r, width, generator=g).to(device, dtype),
              buf_gate=torch.randn(rows, r, width, generator=g).to(device, dtype))
    if overlap:
        st |= dict(ov_kv=torch.randn(blocks, r, d, generator=g).to(device, dtype),
                   ov_gate=torch.randn(blocks, r, d, generator=g).to(device))
    return st


def _params(r: int, d: int, half: int, overlap: bool, device, g):
    width = 2 * d if overlap else d
    return dict(position_bias=(0.5 * torch.randn(r, width, generator=g)).to(device),
                norm_weight=(1 + 0.1 * torch.randn(d, generator=g)).to(device), eps=1e-6,
                inv_freq=(1.0 / 100 ** (torch.arange(half) / max(half, 1))).to(device),
                rope_scale=1.1)


def _steps(r, d, half, overlap, block_size, starts, pad, dtype, device, steps, tol,
           with_pool=False):
    g = torch.Generator().manual_seed(r * 1000 + d + len(starts))
    n_seq = len(starts)
    blocks_per = 4
    tables = torch.arange(1, 1 + n_seq * blocks_per).view(n_seq, blocks_per)  # block 0: null
    slots = torch.arange(n_seq) + 1  # slot 0 unused: rows address their own
    if pad:  # a CUDA graph's pad row: a copy of row 0
        tables, slots = torch.cat([tables, tables[:1]]), torch.cat([slots, slots[:1]])
    b = tables.shape[0]
    writer = torch.tensor([0 if pad and i == b - 1 else i for i in range(b)])
    ref = _state(n_seq + 1, r, d, overlap, 1 + n_seq * blocks_per, dtype, device, g)
    got = {k: v.clone() for k, v in ref.items()}
    prm = _params(r, d, half, overlap, device, g)
    pos = torch.tensor(list(starts) + ([starts[0]] if pad else []))
    for _ in range(steps):
        kv = torch.randn(b, (2 if overlap else 1) * d, generator=g).to(device, dtype)
        gate = torch.randn(b, (2 if overlap else 1) * d, generator=g).to(device, dtype)
        idx = dict(writer=writer.to(device), slots=slots.to(device), positions=pos.to(device),
                   tables=tables.to(device))
        want, want_dst = compress_decode_ref(kv, gate, **idx, **ref, **prm, block_size=block_size)
        out = torch.full((b, d), float("nan"), dtype=dtype, device=device)
        # the flat entry rows of every block (block 0: the null block)
        pool = torch.full(((1 + n_seq * blocks_per) * (block_size // r), d), -3.0,
                          dtype=dtype, device=device)
        _, dst = compress_decode(kv, gate, **idx, **got, **prm, block_size=block_size,
                                 ent=torch.empty_like(out), out=out,
                                 dst=torch.full((b,), -7, dtype=torch.long, device=device),
                                 pool=pool if with_pool else None)
        assert torch.equal(dst, want_dst)
        closing = want_dst != 0
        torch.testing.assert_close(out[closing].float(), want[closing].float(), **tol)
        if with_pool:  # the closing rows' entries at their rows, nothing anywhere else
            torch.testing.assert_close(pool[want_dst[closing]].float(), want[closing].float(),
                                       **tol)
            untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=device)
            untouched[want_dst[closing]] = False
            assert (pool[untouched] == -3.0).all()
        for k in ref:  # state: every slot's window, every real block's Ca slice
            lo = 1 if k.startswith("ov") else 0
            torch.testing.assert_close(got[k][lo:].float(), ref[k][lo:].float(), **tol)
        pos = pos + 1
    return True


@pytest.mark.parametrize("r,d,half,overlap,block_size,starts,pad", [
    (4, 20, 4, True, 8, (0, 5, 11), False),   # CSA-like: overlap, windows closing per row
    (4, 20, 4, True, 4, (6,), True),          # a window per block: the Ca slice crosses blocks
    (3, 70, 35, False, 6, (1, 2), False),     # HCA-like, rope as wide as the entry, odd rate
    (8, 9, 2, False, 16, (4, 0), True),       # wider window than the kernel's row tile
    (1, 12, 3, True, 2, (0, 3), False),       # rate 1: every token closes a window
])
@pytest.mark.parametrize("with_pool", [False, True], ids=["out", "pool"])
def test_compress_decode_matches_reference(interpret, r, d, half, overlap, block_size, starts, pad,
                                           with_pool):
    _steps(r, d, half, overlap, block_size, starts, pad, torch.float32, "cpu", steps=2 * r + 1,
           tol=dict(rtol=1e-5, atol=1e-5), with_pool=with_pool)


def test_compress_decode_names_the_bad_argument(interpret):
    g = torch.Generator().manual_seed(0)
    st = _state(2, 4, 8, True, 3, torch.float32, "cpu", g)
    prm = _params(4, 8, 2, True, "cpu", g)
    idx = dict(writer=torch.tensor([0]), slots=torch.tensor([1]), positions=torch.tensor([3]),
               tables=torch.tensor([[1, 2]]))
    kw = dict(ent=torch.empty(1, 8), out=torch.empty(1, 8), dst=torch.empty(1, dtype=torch.long))
    kv = torch.randn(1, 16)
    with pytest.raises(KernelArgumentError, match="block_size"):
        compress_decode(kv, kv, **idx, **st, **prm, block_size=6, **kw)
    with pytest.raises(KernelArgumentError, match="ov_gate"):
        compress_decode(kv, kv, **idx, **(st | {"ov_gate": None}), **prm, block_size=8, **kw)
    with pytest.raises(KernelArgumentError, match="gate"):
        compress_decode(kv, kv[:, :15], **idx, **st, **prm, block_size=8, **kw)
    with pytest.raises(KernelArgumentError, match="pool"):
        compress_decode(kv, kv, **idx, **st, **prm, block_size=8, **kw, pool=torch.empty(9, 7))
    with pytest.raises(KernelArgumentError, match="pool"):
        compress_decode(kv, kv, **idx, **st, **prm, block_size=8, **kw,
                        pool=torch.empty(9, 8, dtype=torch.float64))
    with pytest.raises(KernelArgumentError, match="positions"):
        compress_decode(kv, kv, **(idx | {"positions": torch.tensor([3], dtype=torch.int32)}), **st,
                        **prm, block_size=8, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("r,d,overlap", [(4, 512, True), (4, 128, True), (128, 512, False)])
def test_compress_decode_on_cuda(cuda, r, d, overlap):
    _steps(r, d, 32, overlap, 256, (0, 100, 255, 3 * r - 2), True, torch.bfloat16, "cuda",
           steps=r + 2 if r < 64 else 3, tol=dict(rtol=2e-2, atol=2e-2), with_pool=True)
