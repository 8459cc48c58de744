"""How a split-K FP8 GEMV cuts K and how many tile counters it uses: host-side arithmetic that
the wrapper (``kernels.fp8_linear``: scratch sizes, the semaphore check) and the Triton launch
(``kernels._fp8_linear_triton``) must agree on, so it lives below both.
"""

from __future__ import annotations


def gemv_k_split(k: int, block_k: int, split: int) -> int:
    """K columns of one slice when ``k`` is cut into at most ``split`` slices of whole K-tiles."""
    tiles = -(-k // block_k)
    return -(-tiles // max(split, 1)) * block_k


def gemv_num_splits(k: int, block_k: int, split: int) -> int:
    """Slices actually launched: ``split`` or fewer, none of them empty."""
    return -(-k // gemv_k_split(k, block_k, split))


def gemv_semaphores_needed(m: int, n: int, tiles: tuple[int, ...], form: str,
                           groups: int = 1) -> int:
    """Counters a split-K launch uses: one per output tile (``n`` outputs over all groups)."""
    bm, bn = tiles[0], tiles[1]
    rows = m if form == "sum" else -(-m // bm)
    return rows * -(-(n // groups) // bn) * groups
