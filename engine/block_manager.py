"""Hands out the fixed pool of KV blocks and reuses prefixes by chained block hashes.

Plain data: block ids and token ids, never tensors. The pool size is decided at start-up and never
grows; when it is empty the scheduler preempts (a planned path), it never allocates more.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

NULL_BLOCK = 0  # never handed out: padding for block tables, sink for warm-up writes


def chain_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of a full block given the hash of every block before it (so equal hashes mean equal
    prefixes, not just equal blocks)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b",".join(str(t).encode() for t in token_ids))
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True,
                 can_resume_after: Callable[[int], bool] | None = None) -> None:
        assert num_blocks >= 2, "need at least the null block and one usable block"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        # whether a sequence can continue at the end of a block (the layout's answer): a prefix
        # hit is cut back to the last block where it can
        self._can_resume_after = can_resume_after or (lambda block: True)
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        # Free blocks in eviction order (least recently freed first). A freed block keeps its hash
        # and can be revived by a prefix hit until it is handed out again.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached run of full leading blocks of ``token_ids``."""
        if not self.enable_prefix_cache:
            return []
        matched: list[int] = []
        parent = b""
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = chain_hash(parent, token_ids[start : start + self.block_size])
            block = self._hash_to_block.get(parent)
            if block is None:
                break
            matched.append(block)
        return matched

    def allocate(self, token_ids: Sequence[int], num_tokens: int, max_cached_tokens: int) -> tuple[
        list[int], int
    ] | None:
        """Blocks for the first ``num_tokens`` tokens of a sequence, reusing cached full blocks of
        ``token_ids`` up to ``max_cached_tokens``. Returns (block_ids, num_cached_tokens), or None
        (and changes nothing) when the pool cannot hold it."""
        cached = self.match_prefix(token_ids)[: max_cached_tokens // self.block_size]
        while cached and not self._can_resume_after(cached[-1]):
            cached.pop()
        num_new = self.blocks_needed(num_tokens) - len(cached)
        revived = sum(1 for b in cached if self._ref_counts[b] == 0)
        if num_new + revived > self.num_free_blocks:
            return None
        for b in cached:
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1
        blocks = cached + [self._pop_free() for _ in range(max(num_new, 0))]
        return blocks, len(cached) * self.block_size

    def append_slots(self, block_ids: list[int], num_tokens: int) -> bool:
        """Grow ``block_ids`` in place to hold ``num_tokens``; False (unchanged) if the pool is dry."""
        need = self.blocks_needed(num_tokens) - len(block_ids)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        block_ids.extend(self._pop_free() for _ in range(need))
        return True

    def register_full_blocks(self, block_ids: list[int], hashes: list[bytes],
                             tokens: Callable[[int, int], Sequence[int]], num_computed: int) -> None:
        """Publish the hashes of blocks whose every token's KV is now computed. ``hashes`` holds
        the chain of the blocks already hashed and is extended in place, so each block is hashed
        once in a sequence's life; ``tokens(start, end)`` returns the sequence's tokens."""
        if not self.enable_prefix_cache:
            return
        bs = self.block_size
        for i in range(len(hashes), num_computed // bs):
            parent = chain_hash(hashes[-1] if hashes else b"", tokens(i * bs, (i + 1) * bs))
            hashes.append(parent)
            block = block_ids[i]
            if self._block_hash[block] is None and parent not in self._hash_to_block:
                self._block_hash[block] = parent
                self._hash_to_block[parent] = block

    def free(self, block_ids: list[int]) -> None:
        # Reverse order so a sequence's tail blocks are evicted before its head (heads are the
        # prefixes most likely to be shared).
        for b in reversed(block_ids):
            assert self._ref_counts[b] > 0, f"double free of block {b}"
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None

    @property
    def num_blocks_in_use(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def forget_cached_prefixes(self) -> None:
        """Drop every cached prefix: the free blocks' contents are about to be overwritten (a
        re-run of the warm-up). Only when no block is in use."""
        if self.num_blocks_in_use:
            raise RuntimeError(f"{self.num_blocks_in_use} block(s) are in use: their sequences "
                               "must finish or be released first")
        self._block_hash = [None] * self.num_blocks
        self._hash_to_block.clear()

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        old = self._block_hash[block]
        if old is not None:
            self._block_hash[block] = None
            if self._hash_to_block.get(old) == block:
                del self._hash_to_block[old]
        self._ref_counts[block] = 1
        return block
