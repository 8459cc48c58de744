"""``gdc_wait`` for the kernels that take a ``PDL`` constexpr (programmatic dependent launch,
see kernels/NOTES.md): triton's own where it has one, else a no-op that is never reached
(``kernels._triton_support.pdl_launch`` is then False, so ``PDL`` stays False)."""

from __future__ import annotations

import triton

try:
    from triton.language.extra.cuda import gdc_wait
except Exception:  # noqa: BLE001  (a triton without griddepcontrol)

    @triton.jit
    def gdc_wait():  # type: ignore[no-redef]
        pass


__all__ = ["gdc_wait"]
