"""Hands the C heap that a worker's start-up freed back to the operating system.

Loading dequantizes every weight through float32 temporaries of a few MiB each, below glibc's
mmap threshold, so they come from the heap; freed, they stay in the process's resident set as
free heap (45 MiB a worker for SmolLM2-135M on the CPU, measured with lab/scripts/up_footprint.py).
``malloc_trim(0)`` once start-up is over returns those pages. Nothing else is changed; on a C
library without ``malloc_trim`` (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util


def trim_heap() -> bool:
    """``malloc_trim(0)``; whether it released anything (False where there is none)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
    except OSError:
        return False
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
