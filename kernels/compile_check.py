"""``python -m kernels.compile_check``: compile every Triton kernel for an H100/H200 (sm_90) on a
machine without a GPU, and report shared memory, registers and spills. ``--records FILE``:
compile instead the launches a :class:`LaunchRecorder` saw under the interpreter (what the
engine really passed; ``lab.bench.deepseek_v4.count_launches --record FILE`` writes one).
Kernels that take a ``PDL`` constexpr (programmatic dependent launch, kernels/NOTES.md) are
compiled with it on as well (every default spec of theirs twice, each record with it on unless
``--no-pdl``), and their PTX must wait on the grid dependency before any global memory access.

Catches what the CPU interpreter cannot (non-constexpr globals, shapes the GPU backend rejects,
register spills) before any GPU time is spent. Pointer arguments and strides are declared
16-divisible, as Triton specialises them at a real launch; without that its software pipeliner
stays off and the report would describe different code. Needs a triton with the NVIDIA backend
(the PyPI wheel has it). Diagnostic only: the engine never imports it (lab.bench.deepseek_v4.count_launches does, for
its LaunchRecorder), and it never runs a kernel. The tables of what it compiles by default are
``kernels._compile_specs`` (and ``_compile_specs_quant``); this module is the driver.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field, replace

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels._compile_specs import default_specs
from kernels._kernel_spec import KernelSpec
from kernels._triton_support import PDL_PREFETCH, PDL_TRIGGER, PDL_WAIT

__all__ = ["CompileResult", "KernelSpec", "LaunchRecorder", "check_all", "default_specs", "main"]

_DIV16_INTS = {"num_heads", "head_dim", "num_q_heads"}


@dataclass
class CompileResult:
    name: str
    ok: bool
    shared_bytes: int = 0
    registers: int | None = None
    spill_bytes: int | None = None
    uses_wgmma: bool = False
    error: str = ""
    notes: list[str] = field(default_factory=list)


PDL_ALL = PDL_WAIT | PDL_TRIGGER | PDL_PREFETCH


def takes_pdl(fn: object) -> bool:
    """Whether a kernel has the ``PDL`` constexpr (launched with ``launch_pdl`` on sm_90+)."""
    return "PDL" in inspect.signature(fn.fn).parameters  # type: ignore[attr-defined]


def with_pdl(specs: list[KernelSpec]) -> list[KernelSpec]:
    """``specs`` and, after them, each spec of a kernel that takes ``PDL`` with every bit of it
    on (wait, trigger, prefetch: the code of any other mode is a subset)."""
    return specs + [replace(s, name=f"{s.name} [PDL]", constexprs=s.constexprs | {"PDL": PDL_ALL})
                    for s in specs if takes_pdl(s.fn) and "PDL" not in s.constexprs]


# a global load, store or atomic, or an async copy (predicated or not) in PTX; not an L2 bulk
# prefetch (``l2_prefetch``: loads nothing into the program, asked only for weights)
_GLOBAL_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ld\.global|st\.global|atom\.|red\.|"
                            r"cp\.async(?!\.bulk\.prefetch)|cp\.reduce\.async)", re.M)


def pdl_wait_problem(ptx: str) -> str:
    """'' when the PTX waits on the grid dependency (``griddepcontrol.wait``) before its first
    global load, store or atomic (a PDL launch may start before the previous kernel's writes
    are visible); else what is wrong."""
    wait = ptx.find("griddepcontrol.wait")
    if wait < 0:
        return "PDL on but no griddepcontrol.wait in the PTX"
    first = _GLOBAL_ACCESS.search(ptx)
    if first is not None and first.start() < wait:
        line = ptx[first.start():ptx.find("\n", first.start() + 1)].strip()
        return f"PDL on but global memory is accessed before griddepcontrol.wait: {line}"
    return ""


def _ptxas() -> str | None:
    base = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):  # the newer one reads the newer PTX
        path = os.path.join(base, name)
        if os.path.exists(path):
            return path
    return None


def _ptx_resources(ptx: str, ptxas: str) -> tuple[int | None, int | None]:
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.o")],
                              capture_output=True, text=True, check=False)
    regs = re.search(r"Used (\d+) registers", proc.stderr)
    spills = re.search(r"(\d+) bytes spill stores", proc.stderr)
    return (int(regs.group(1)) if regs else None, int(spills.group(1)) if spills else None)


def compile_one(spec: KernelSpec, target: GPUTarget) -> CompileResult:
    sig = inspect.signature(spec.fn.fn)  # type: ignore[attr-defined]
    params = list(sig.parameters)
    # constexpr parameters the spec leaves out take their defaults, as a launch would
    given = {p: v.default for p, v in sig.parameters.items()
             if v.default is not inspect.Parameter.empty and "constexpr" in str(v.annotation)}
    given.update(spec.constexprs)
    signature = {p: "constexpr" if p in given else spec.types.get(p, "i32") for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if signature[p].startswith("*") or p.startswith("stride") or p in _DIV16_INTS}
    constexprs = {(params.index(k),): v for k, v in given.items()}
    pdl = bool(given.get("PDL"))
    options: dict[str, object] = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    if pdl:
        options["launch_pdl"] = True
    try:
        kernel = triton.compile(ASTSource(fn=spec.fn, signature=signature, constexprs=constexprs,
                                          attrs=attrs),
                                target=target, options=options)
    except Exception as exc:  # report every kernel, not just the first failure
        return CompileResult(spec.name, ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
    result = CompileResult(spec.name, ok=True, shared_bytes=int(kernel.metadata.shared),
                           uses_wgmma="wgmma" in kernel.asm["ptx"])
    if pdl and (problem := pdl_wait_problem(kernel.asm["ptx"])):
        result.ok, result.error = False, problem
    ptxas = _ptxas()
    if ptxas and target.arch == 90:
        result.registers, result.spill_bytes = _ptx_resources(kernel.asm["ptx"], ptxas)
    return result


_TORCH_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int64": "i64",
                "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1",
                "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}


def _arg_type(value: object) -> str | None:
    """The Triton type a launch gives a runtime argument (None: passed as a constexpr)."""
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _TORCH_TYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2 ** 31) <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def _json_value(value: object) -> object:
    import triton.language as tl

    return {"tl_dtype": str(value)} if isinstance(value, tl.dtype) else value


class LaunchRecorder:
    """Under ``TRITON_INTERPRET=1``, records each distinct Triton launch made inside the
    ``with`` block (kernel, argument types, constexpr values, warps, stages) so that
    :func:`specs_from_records` can compile exactly what ran, for each GPU: a kernel that the
    interpreter runs but that the GPU backend rejects for the types a caller passes (an int64
    where an int32 was assumed) shows before any GPU time is spent. The interpreter's own tile
    choices (``interpreting()``) are what get recorded, not the GPU's; the specs above cover
    those."""

    def __init__(self) -> None:
        self.records: dict[str, dict] = {}

    def __enter__(self) -> LaunchRecorder:
        import json

        import triton.runtime.interpreter as interp

        self._interp = interp
        self._run = run = interp.InterpretedFunction.run

        def recorded(fn_self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
            params = inspect.signature(fn_self.fn).parameters
            bound = dict(zip(fn_self.arg_names, args, strict=False))
            bound.update({k: v for k, v in kwargs.items() if k in params})
            types, consts = {}, {}
            for name, value in bound.items():
                kind = _arg_type(value)
                if "constexpr" in str(params[name].annotation) or kind is None:
                    consts[name] = _json_value(value)
                else:
                    types[name] = kind
            rec = {"module": fn_self.fn.__module__, "kernel": fn_self.fn.__name__,
                   "types": types, "constexprs": consts,
                   "num_warps": int(kwargs.get("num_warps", 4)),
                   "num_stages": int(kwargs.get("num_stages", 2))}
            self.records.setdefault(json.dumps(rec, sort_keys=True, default=str), rec)
            return run(fn_self, *args, grid=grid, warmup=warmup, **kwargs)

        interp.InterpretedFunction.run = recorded  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self._interp.InterpretedFunction.run = self._run  # type: ignore[method-assign]

    def dump(self, path: str) -> None:
        import json

        with open(path, "w") as f:
            json.dump(list(self.records.values()), f, indent=1)


def specs_from_records(path: str, pdl: bool = True) -> list[KernelSpec]:
    """:class:`LaunchRecorder`'s file -> specs (in a process without the interpreter, where the
    kernels are JIT functions that compile). ``pdl``: a kernel that takes ``PDL`` gets it on, as
    a launch on sm_90/sm_120 passes it (the interpreter never does)."""
    import importlib
    import json

    import triton.language as tl

    specs = []
    with open(path) as f:
        for rec in json.load(f):
            fn = getattr(importlib.import_module(rec["module"]), rec["kernel"])
            consts = {k: tl.dtype(v["tl_dtype"]) if isinstance(v, dict) else v
                      for k, v in rec["constexprs"].items()}
            if pdl and takes_pdl(fn) and "PDL" not in consts:
                consts["PDL"] = PDL_ALL
            label = ", ".join(f"{k}={v}" for k, v in sorted(consts.items())
                              if not isinstance(v, tl.dtype))
            types = ",".join(f"{k}:{v}" for k, v in sorted(rec["types"].items()))
            specs.append(KernelSpec(f"{rec['kernel']} [{label}] ({types})", fn, rec["types"],
                                    consts, rec["num_warps"], rec["num_stages"]))
    return specs


def check_all(specs: list[KernelSpec] | None = None, arch: int = 90) -> list[CompileResult]:
    """``arch`` 90 (H100/H200) or 120 (RTX PRO 6000 / RTX 50xx): the portable kernels must
    compile for both; registers are read by ptxas for sm_90a only."""
    target = GPUTarget("cuda", arch, 32)
    return [compile_one(s, target) for s in (specs or with_pdl(default_specs()))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, choices=(90, 120))
    parser.add_argument("--records", help="compile the launches a LaunchRecorder wrote here "
                                          "instead of the default specs")
    parser.add_argument("--no-pdl", action="store_true",
                        help="with --records: compile the launches with PDL off, as recorded "
                             "(default: on where the kernel takes it, as sm_90/sm_120 launch it)")
    parser.add_argument("--failures-only", action="store_true", help="table rows of failures")
    args = parser.parse_args(argv)
    results = check_all(specs_from_records(args.records, pdl=not args.no_pdl)
                        if args.records else None, arch=args.arch)
    print("| kernel | compiles | shared KiB | registers | spill bytes | wgmma |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if args.failures_only and r.ok:
            continue
        print(f"| {r.name} | {'yes' if r.ok else 'NO'} | {r.shared_bytes / 1024:.0f} | "
              f"{r.registers if r.registers is not None else '-'} | "
              f"{r.spill_bytes if r.spill_bytes is not None else '-'} | "
              f"{'yes' if r.uses_wgmma else 'no'} |")
    for r in results:
        if not r.ok:
            print(f"\n{r.name}:\n{r.error}")
    print(f"{sum(r.ok for r in results)} of {len(results)} compile for sm_{args.arch}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
