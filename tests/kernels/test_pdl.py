"""Programmatic dependent launch (kernels/NOTES.md): when ``pdl_launch`` turns it on, and the
safety rule, checked on the source: every kernel that takes ``PDL`` waits on the grid dependency
(``if PDL: gdc_wait()``) as its very first statement, and every launch of such a kernel passes
``pdl_kwargs`` (both the constexpr and ``launch_pdl``, or neither). CPU only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from kernels import _triton_support as ts

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
UNCHANGED_LAUNCHERS: set[str] = set()  # launchers exempt from the rule: none


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device of compute capability ``fake_cuda[0]`` outside the interpreter."""
    cap = [(9, 0)]
    monkeypatch.setattr(ts, "interpreting", lambda: False)
    monkeypatch.setattr(ts, "_gdc_importable", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: cap[0])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(ts, "_PDL_DEVICES", {})
    monkeypatch.delenv("BULKHEAD_PDL", raising=False)
    return cap


def test_pdl_off_on_cpu() -> None:
    assert ts.pdl_launch(torch.device("cpu")) is False
    assert ts.pdl_kwargs(torch.device("cpu")) == {}


def test_pdl_on_for_sm90_and_sm120(fake_cuda) -> None:
    assert ts.pdl_launch(torch.device("cuda", 0)) is True
    assert ts.pdl_launch(torch.device("cuda")) is True
    assert ts.pdl_kwargs(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    fake_cuda[0] = (12, 0)
    assert ts.pdl_launch(torch.device("cuda", 1)) is True


def test_pdl_off_before_hopper(fake_cuda) -> None:
    fake_cuda[0] = (8, 9)
    assert ts.pdl_launch(torch.device("cuda", 0)) is False
    assert ts.pdl_kwargs(torch.device("cuda", 0)) == {}


def test_pdl_switched_off_by_env(fake_cuda, monkeypatch) -> None:
    assert ts.pdl_launch(torch.device("cuda", 0)) is True
    monkeypatch.setenv("BULKHEAD_PDL", "0")  # read at every call, not cached
    assert ts.pdl_launch(torch.device("cuda", 0)) is False
    assert ts.pdl_kwargs(torch.device("cuda", 0)) == {}
    monkeypatch.setenv("BULKHEAD_PDL", "1")
    assert ts.pdl_launch(torch.device("cuda", 0)) is True


def test_pdl_modes_from_env(fake_cuda, monkeypatch) -> None:
    dev = torch.device("cuda", 0)
    for raw, bits in (("", ts.PDL_DEFAULT), ("1", ts.PDL_DEFAULT), ("wait", ts.PDL_WAIT),
                      ("trigger", ts.PDL_WAIT | ts.PDL_TRIGGER),
                      ("Prefetch", ts.PDL_WAIT | ts.PDL_PREFETCH),
                      ("trigger+prefetch", 7), ("prefetch, trigger", 7)):
        monkeypatch.setenv("BULKHEAD_PDL", raw)
        assert ts.pdl_mode() == bits, raw
        assert ts.pdl_kwargs(dev) == {"PDL": bits, "launch_pdl": True}, raw
    monkeypatch.setenv("BULKHEAD_PDL", "trigger,eager")
    with pytest.raises(ValueError, match="BULKHEAD_PDL.*'eager'"):
        ts.pdl_mode()


def test_pdl_off_under_interpreter_or_without_gdc(fake_cuda, monkeypatch) -> None:
    monkeypatch.setattr(ts, "interpreting", lambda: True)
    assert ts.pdl_launch(torch.device("cuda", 0)) is False
    monkeypatch.setattr(ts, "interpreting", lambda: False)
    monkeypatch.setattr(ts, "_gdc_importable", lambda: False)
    assert ts.pdl_launch(torch.device("cuda", 0)) is False


def _modules() -> list[tuple[Path, ast.Module]]:
    """The kernel modules (not ``_pdl_triton``, whose ``pdl_wait`` is the wait itself)."""
    return [(p, ast.parse(p.read_text())) for p in sorted(KERNELS.glob("_*_triton.py"))
            if p.name != "_pdl_triton.py"]


def _pdl_kernels() -> dict[str, Path]:
    out = {}
    for path, tree in _modules():
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef) and any(a.arg == "PDL" for a in fn.args.args):
                out[fn.name] = path
    return out


def test_pdl_kernels_wait_first() -> None:
    kernels = _pdl_kernels()
    helpers = {fn.name: fn for _, tree in _modules() for fn in tree.body
               if isinstance(fn, ast.FunctionDef) and fn.name.startswith("_prefetch_")}
    assert {"_fp8_gemv_kernel", "_rope_norm_kernel", "_hc_mix_kernel", "_sparse_attention_kernel",
            "_moe_route_kernel", "_moe_combine_kernel", "_topk_merge_kernel"} <= set(kernels)
    for path, tree in _modules():
        for fn in tree.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name in kernels):
                continue
            body = fn.body
            if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            first = ast.unparse(body[0])
            if first.startswith("if PDL & 4:"):  # the weight prefetch, then the wait
                _assert_prefetch_only(body[0], helpers, fn.name)
                first = ast.unparse(body[1])
            assert first == "pdl_wait(PDL)", (path.name, fn.name, first)
            default = fn.args.defaults[-1] if fn.args.args[-1].arg == "PDL" else None
            assert default is not None and ast.literal_eval(default) == 0, (
                f"{fn.name}: PDL must be the last parameter, default 0")


_MEMORY_OPS = ("tl.load", "tl.store", "tl.atomic", "tl.inline_asm")


def _assert_prefetch_only(block: ast.If, helpers: dict[str, ast.FunctionDef], kernel: str) -> None:
    """What a kernel runs before ``pdl_wait``: calls of ``_prefetch_*`` helpers that touch
    memory only through ``l2_prefetch`` (no load, store or atomic)."""
    for stmt in block.body:
        assert isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call), (kernel, ast.unparse(stmt))
        name = ast.unparse(stmt.value.func)
        assert name.startswith("_prefetch_") and name in helpers, (kernel, name)
        src = ast.unparse(helpers[name])
        assert not any(op in src for op in _MEMORY_OPS), (kernel, name)
        assert "l2_prefetch(" in src, (kernel, name)


def test_l2_prefetch_loads_nothing() -> None:
    """The one asm the prefetch runs: a bulk L2 prefetch from one thread, no register load."""
    src = (KERNELS / "_pdl_triton.py").read_text()
    tree = ast.parse(src)
    fn = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "l2_prefetch")
    asm = "".join(c.value for c in ast.walk(fn) if isinstance(c, ast.Constant)
                  and isinstance(c.value, str) and "cp." in c.value)
    assert "cp.async.bulk.prefetch.L2.global" in asm and "%tid.x" in asm
    assert "ld." not in asm and "st." not in asm


def test_pdl_kernels_launched_with_pdl_kwargs() -> None:
    kernels = _pdl_kernels()
    launches = 0
    for path, tree in _modules():
        for launcher in tree.body:
            if not isinstance(launcher, ast.FunctionDef) or launcher.name in UNCHANGED_LAUNCHERS:
                continue
            for node in ast.walk(launcher):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                        and isinstance(node.func.value, ast.Name)
                        and node.func.value.id in kernels):
                    continue
                launches += 1
                names = {k.arg for k in node.keywords}
                spread = [ast.unparse(k.value) for k in node.keywords if k.arg is None]
                assert "PDL" not in names and "launch_pdl" not in names, (
                    path.name, launcher.name, "pass them together through pdl_kwargs")
                assert spread and all(s == "pdl" or s.startswith("pdl_kwargs(") for s in spread), (
                    path.name, launcher.name, node.func.value.id, spread)
    assert launches >= 20
