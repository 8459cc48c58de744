from engine.block_manager import NULL_BLOCK, BlockManager


def register(bm, blocks, tokens, num_computed, hashes=None):
    hashes = [] if hashes is None else hashes
    bm.register_full_blocks(blocks, hashes, lambda a, b: tokens[a:b], num_computed)
    return hashes


def test_allocate_free_and_null_block_never_handed_out():
    bm = BlockManager(num_blocks=5, block_size=4)
    got = bm.allocate(list(range(10)), 11, max_cached_tokens=9)
    assert got is not None
    blocks, cached = got
    assert len(blocks) == 3 and cached == 0 and NULL_BLOCK not in blocks
    assert bm.num_free_blocks == 1
    assert bm.allocate(list(range(100, 110)), 11, 9) is None  # pool dry: nothing changes
    assert bm.num_free_blocks == 1
    bm.free(blocks)
    assert bm.num_free_blocks == 4


def test_prefix_reuse_by_chained_hash():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(11))
    blocks, _ = bm.allocate(prompt, 12, 10)
    register(bm, blocks, prompt, 11)  # two full blocks computed
    bm.free(blocks)
    # same first 8 tokens, different tail: two blocks reused, revived from the free list
    other = prompt[:8] + [99, 98, 97]
    blocks2, cached = bm.allocate(other, 12, 10)
    assert cached == 8 and blocks2[:2] == blocks[:2]
    # a different first block breaks the chain even if the second block's tokens match
    third = [7] + prompt[1:]
    _, cached3 = bm.allocate(third, 12, 10)
    assert cached3 == 0


def test_cached_prefix_is_capped_so_last_token_is_computed():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(8))
    blocks, _ = bm.allocate(prompt, 9, 7)
    register(bm, blocks, prompt, 8)
    bm.free(blocks)
    _, cached = bm.allocate(prompt, 9, max_cached_tokens=7)
    assert cached == 4  # only whole blocks below the cap


def test_evicted_block_loses_its_hash():
    bm = BlockManager(num_blocks=3, block_size=2)  # two usable blocks
    p = [1, 2, 3]
    blocks, _ = bm.allocate(p, 4, 2)
    register(bm, blocks, p, 2)
    bm.free(blocks)
    blocks2, _ = bm.allocate([5, 6, 7], 4, 2)  # reuses both blocks, evicting the hash
    assert bm.match_prefix(p) == []
    bm.free(blocks2)


def test_registration_is_incremental_and_matches_a_full_rehash():
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(20))
    blocks, _ = bm.allocate(tokens, 21, 19)
    hashes: list[bytes] = []
    for n in (3, 5, 9, 9, 17, 20):  # computed count grows step by step
        register(bm, blocks, tokens, n, hashes)
    assert len(hashes) == 5
    fresh = BlockManager(num_blocks=16, block_size=4)
    b2, _ = fresh.allocate(tokens, 21, 19)
    assert register(fresh, b2, tokens, 20) == hashes
    assert bm.match_prefix(tokens) == blocks[:5]
