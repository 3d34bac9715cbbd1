"""The block manager: tables cover their tokens, references are counted, full blocks are shared."""

import random

from hybridmoe.engine.block_manager import BlockManager
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.engine.sequence import Sequence


def seq(tokens, rid="r"):
    return Sequence(rid, tokens, SamplingParams(), max_len=10_000)


def compute(bm, s, n):
    """What the engine does: blocks for n more tokens, 'run' them, key the full blocks."""
    assert bm.grow(s, s.num_computed + n)
    s.num_computed += n
    bm.commit(s)


def check_invariants(bm, live):
    refs = {}
    for s in live:
        for b in s.block_table:
            refs[b] = refs.get(b, 0) + 1
        assert len(s.block_table) * bm.block_size >= s.num_computed
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.id, 0), f"block {block.id}"
        assert (block.id in bm.free) == (block.ref_count == 0)
    for key, block in bm.by_key.items():
        assert block.key == key


def test_grow_covers_tokens_and_release_returns_every_block():
    bm = BlockManager(10, 4)
    s = seq(list(range(9)))
    assert bm.grow(s, 9) and len(s.block_table) == 3 and bm.num_free == 7
    assert not bm.grow(s, 41) and len(s.block_table) == 3  # all or nothing
    bm.release(s)
    assert bm.num_free == 10 and s.block_table == []


def test_a_repeated_prefix_takes_the_cached_full_blocks_but_never_the_last_token():
    bm = BlockManager(16, 4)
    system = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]  # 2 full blocks + 2 tokens
    a = seq(system + [1, 2], "a")
    compute(bm, a, len(a))
    b = seq(system + [3], "b")
    assert bm.match_prefix(b) == 8 and b.block_table == a.block_table[:2]
    c = seq(
        list(a.token_ids), "c"
    )  # identical to a (12 tokens = 3 full blocks): the last block is recomputed
    assert bm.match_prefix(c) == 8
    check_invariants(bm, [a, b, c])
    assert bm.blocks[a.block_table[0]].ref_count == 3


def test_a_different_earlier_block_breaks_the_match():
    bm = BlockManager(16, 4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    compute(bm, a, 9)
    b = seq([0, 2, 3, 4, 5, 6, 7, 8, 9], "b")  # second block equal, first not: the prefix differs
    assert bm.match_prefix(b) == 0


def test_released_blocks_stay_findable_until_reused_and_unkeyed_ones_go_first():
    bm = BlockManager(4, 2)
    a = seq([1, 2, 3, 4, 5], "a")
    compute(bm, a, 5)  # blocks: [1,2] [3,4] keyed, [5] not
    bm.release(a)
    other = seq([9, 9], "o")
    assert bm.grow(other, 2)  # takes the unkeyed block or the never-used one, not a cached one
    b = seq([1, 2, 3, 4, 6], "b")
    assert bm.match_prefix(b) == 4
    check_invariants(bm, [other, b])


def test_hit_rate_counts_prompt_tokens_found():
    bm = BlockManager(16, 4)
    a = seq(list(range(9)), "a")
    bm.match_prefix(a)
    compute(bm, a, 9)
    b = seq(list(range(9)), "b")
    bm.match_prefix(b)
    assert (bm.hit_tokens, bm.query_tokens) == (8, 18)
    bm.unmatch(b)
    assert (bm.hit_tokens, bm.query_tokens) == (0, 9)
    check_invariants(bm, [a])


def test_random_operations_keep_reference_counts_exact():
    rng = random.Random(0)
    bm = BlockManager(24, 4)
    live = []
    for step in range(400):
        op = rng.random()
        if op < 0.35 and len(live) < 6:
            s = seq([rng.choice([1, 2]) for _ in range(rng.randint(1, 14))], f"s{step}")
            bm.match_prefix(s)
            if bm.grow(s, len(s)):
                s.num_computed = len(s)
                bm.commit(s)
                live.append(s)
            else:
                bm.unmatch(s)
        elif op < 0.7 and live:
            s = rng.choice(live)
            if bm.grow(s, len(s) + 1):
                s.append(rng.choice([1, 2]))
                s.num_computed += 1
                bm.commit(s)
        elif live:
            bm.release(live.pop(rng.randrange(len(live))))
        check_invariants(bm, live)
    for s in live:
        bm.release(s)
    assert bm.num_free == bm.num_blocks


def test_sequences_growing_side_by_side_keep_consecutive_blocks_while_there_is_room():
    bm = BlockManager(64, 4)
    seqs = [seq([i] * 10, f"s{i}") for i in range(4)]
    for s in seqs:
        compute(bm, s, 10)
    for _ in range(12):  # decode, interleaved: 12 more tokens each
        for s in seqs:
            s.append(0)
            compute(bm, s, 1)
    for s in seqs:
        assert s.block_table == list(range(s.block_table[0], s.block_table[0] + len(s.block_table)))
    check_invariants(bm, seqs)
