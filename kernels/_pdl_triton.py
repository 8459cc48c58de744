"""Grid-dependency helpers for the kernels that take a ``PDL`` constexpr (programmatic
dependent launch, see kernels/NOTES.md).

``PDL`` is a bit set (``kernels._triton_support.PDL_*``): 1 wait on the previous kernel first
thing; 2 then let the next kernel launch (its programs become resident and wait in their own
``pdl_wait`` while this one runs); 4 a weight-streaming kernel asks L2 for its weight slice
before it waits (weights are never written during a step, so reading them early is safe).
Where triton has no ``gdc_wait``, no-ops that are never reached (``pdl_launch`` is then False,
so ``PDL`` stays 0)."""

from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except Exception:  # noqa: BLE001  (a triton without griddepcontrol)

    @triton.jit
    def gdc_wait():  # type: ignore[no-redef]
        pass

    @triton.jit
    def gdc_launch_dependents():  # type: ignore[no-redef]
        pass


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """The first statement of every kernel that takes ``PDL``: wait for the previous kernel
    (its writes visible), then, with bit 2, let the next one launch."""
    if PDL:
        gdc_wait()
        if PDL & 2:
            gdc_launch_dependents()


@triton.jit
def l2_prefetch(ptr, nbytes):
    """Ask L2 for ``nbytes`` from ``ptr`` (both multiples of 16; sm_90+): one bulk prefetch,
    issued by thread 0 of the program, not waited on. Loads nothing into registers."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


__all__ = ["gdc_wait", "gdc_launch_dependents", "pdl_wait", "l2_prefetch"]
