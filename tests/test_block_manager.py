"""BlockManager on its own: allocation checked and taken in one call, the prefix cache, and
reference counts and free lists that stay consistent under any order of calls."""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.block_manager import BlockManager, block_hash
from scheduler.sequence import Sequence
from scheduler.tenants import Tenant
from surge.config import TenantConfig
from surge.protocol import SamplingParams


def check_blocks(bm: BlockManager, seqs: Iterable[Sequence]) -> None:
    """Each block's reference count is how many of seqs hold it; a block is free exactly when
    nobody holds it, on one free list, named there only if evictable; names chain over tokens."""
    seqs = list(seqs)
    holders: dict[int, int] = {}
    for seq in seqs:
        live = seq.block_table[seq.released_blocks:]
        assert seq.block_table[: seq.released_blocks] == [bm.null_block] * seq.released_blocks
        assert len(set(live)) == len(live) and bm.null_block not in live
        for b in live:
            holders[b] = holders.get(b, 0) + 1
    free = list(bm.unnamed) + list(bm.evictable)
    assert len(set(free)) == len(free), "a block is free twice"
    for b in range(bm.num_blocks):
        assert bm.ref_count[b] == holders.get(b, 0), f"block {b}: wrong reference count"
        assert (b in free) == (bm.ref_count[b] == 0), f"block {b} is both used and free, or lost"
    assert all(b in bm.name_of for b in bm.evictable)
    assert not any(b in bm.name_of for b in bm.unnamed)
    for h, b in bm.by_hash.items():
        assert bm.name_of[b][0] == h
    for seq in seqs:  # a sequence's names are the chain over its tokens
        parent = None
        for i, h in enumerate(seq.block_hashes):
            tokens = tuple(seq.token_ids[i * bm.block_size : (i + 1) * bm.block_size])
            assert h == block_hash(parent, tokens)
            parent = h


def _seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, str(seq_id), tokens, SamplingParams(max_tokens=1), 0, 0.0,
                    Tenant("default", TenantConfig(), 0.0))


def _computed(bm: BlockManager, seq: Sequence) -> None:
    """A step computed every token seq has slots for."""
    seq.num_computed_tokens = min(len(seq.block_table) * bm.block_size, seq.num_tokens)
    bm.name_full_blocks(seq)


def _state(bm: BlockManager) -> tuple:
    return (list(bm.ref_count), list(bm.unnamed), list(bm.evictable), dict(bm.name_of),
            bm.queried_tokens, bm.hit_tokens)


def test_block_manager_basics():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = _seq(0, list(range(9)))
    assert bm.lookup(seq.token_ids) == []
    assert bm.allocate(seq, 9)
    assert len(seq.block_table) == 3 and bm.num_free == 1
    _computed(bm, seq)
    assert len(seq.block_hashes) == 2
    other = _seq(1, [*range(8), 99])
    assert bm.lookup(other.token_ids) == seq.block_table[:2]
    # An exact copy of a cached prompt still computes its last token.
    assert bm.lookup(list(range(8))) == seq.block_table[:1]
    bm.free(seq)
    assert bm.num_free == 4 and len(bm.evictable) == 2
    assert bm.allocate(other, 9, bm.lookup(other.token_ids))
    assert other.num_computed_tokens == 8 and bm.ref_count[other.block_table[0]] == 1
    assert bm.hit_tokens == 8


def test_allocate_refuses_without_side_effects():
    bm = BlockManager(num_blocks=4, block_size=4)
    held = _seq(0, list(range(12)))
    assert bm.allocate(held, 12)
    state = _state(bm)
    newcomer = _seq(1, list(range(100, 108)))
    assert not bm.allocate(newcomer, 8)  # two blocks, one free
    assert newcomer.block_table == [] and _state(bm) == state  # not even counted as queried
    assert not bm.allocate(held, 20)  # growing past the pool
    assert len(held.block_table) == 3 and _state(bm) == state
    assert bm.allocate(held, 16) and bm.num_free == 0


def test_allocate_counts_cached_hits_nobody_holds_as_free():
    """Taking a hit that nobody holds uses up a free block as surely as a fresh one does."""
    bm = BlockManager(num_blocks=4, block_size=4)
    first = _seq(0, list(range(9)))
    assert bm.allocate(first, 9)
    _computed(bm, first)
    bm.free(first)  # its two full blocks stay cached, held by nobody
    assert bm.allocate(_seq(1, [50]), 1)
    other = _seq(2, [*range(8), 60, 61, 62, 63, 64])
    hits = bm.lookup(other.token_ids)
    assert len(hits) == 2 and bm.num_free == 3
    # Two fresh blocks and the two hits: four, with three free (the hits among them).
    assert bm.blocks_to_allocate(other, 16, hits) == 4
    state = _state(bm)
    assert not bm.allocate(other, 16, hits)
    assert other.block_table == [] and _state(bm) == state
    assert bm.allocate(other, 12, hits)
    assert other.block_table[:2] == hits and other.num_computed_tokens == 8
    assert bm.hit_tokens == 8 and bm.num_free == 0


def test_allocate_after_freeing_counts_only_blocks_really_returned():
    """As preemption does: refused, free someone, ask again. A block another sequence still
    holds does not come back."""
    bm = BlockManager(num_blocks=6, block_size=4)
    first, copy = _seq(0, list(range(9))), _seq(1, list(range(9)))
    assert bm.allocate(first, 9)
    _computed(bm, first)
    assert bm.allocate(copy, 9, bm.lookup(copy.token_ids))  # shares first's two full blocks
    assert bm.num_free == 2
    big = _seq(2, list(range(100, 116)))
    assert not bm.allocate(big, 16)
    bm.free(copy)  # only its own last block comes back
    assert bm.num_free == 3 and not bm.allocate(big, 16)
    bm.free(first)
    assert bm.allocate(big, 16)
    check_blocks(bm, [first, copy, big])


prefixes = [list(range(k * 50, k * 50 + 24)) for k in range(2)]
prompts = st.tuples(st.integers(0, 1), st.integers(0, 24), st.integers(0, 3)).map(
    lambda t: prefixes[t[0]][: t[1]] + [200 + t[2]])


@settings(max_examples=500, deadline=None)
@given(st.lists(prompts, min_size=4, max_size=4),
       st.lists(st.tuples(st.sampled_from(["allocate", "free"]), st.integers(0, 3),
                          st.integers(1, 12)), max_size=60),
       st.integers(2, 16), st.booleans())
def test_allocate_and_free_keep_counts_and_free_lists_consistent(prompts, ops, num_blocks,
                                                                 prefix_cache):
    """allocate succeeds exactly when every block seq would then hold fits the pool beside
    the others' (its hits counted once), and otherwise changes nothing."""
    bm = BlockManager(num_blocks, block_size=4, prefix_cache=prefix_cache)
    seqs = [_seq(i, p) for i, p in enumerate(prompts)]
    for op, which, n in ops:
        seq = seqs[which]
        if op == "allocate":
            hits = [] if seq.block_table else bm.lookup(seq.token_ids)
            start = list(seq.block_table or hits)
            num_tokens = len(start) * bm.block_size + n
            in_use = {b for s in seqs for b in s.block_table} | set(hits)
            fits = len(in_use) + bm.blocks_for(num_tokens) - len(start) <= num_blocks
            before = _state(bm), list(seq.block_table)
            assert bm.allocate(seq, num_tokens, hits) == fits
            if fits:
                assert seq.block_table[: len(start)] == start
                assert len(seq.block_table) == bm.blocks_for(num_tokens)
                _computed(bm, seq)
            else:
                assert (_state(bm), seq.block_table) == before
        else:
            bm.free(seq)
        check_blocks(bm, seqs)
    for seq in seqs:
        bm.free(seq)
    assert bm.num_free == num_blocks


@settings(deadline=None)
@given(st.lists(prompts, min_size=4, max_size=4),
       st.lists(st.tuples(st.sampled_from(["allocate", "free", "report", "forget"]),
                          st.integers(0, 3), st.integers(1, 12)), max_size=60),
       st.integers(2, 16))
def test_reports_keep_the_router_in_step_with_the_cached_chain_heads(prompts, ops, num_blocks):
    """Applying every report in turn gives exactly the named blocks within report_depth of
    their chain's head, however blocks are named, evicted or forgotten."""
    bm = BlockManager(num_blocks, block_size=4)
    bm.report_depth = 2
    seqs = [_seq(i, p) for i, p in enumerate(prompts)]
    mirror: set[bytes] = set()
    for op, which, n in ops:
        seq = seqs[which]
        if op == "allocate":
            hits = [] if seq.block_table else bm.lookup(seq.token_ids)
            num_tokens = len(seq.block_table or hits) * bm.block_size + n
            if bm.allocate(seq, num_tokens, hits):
                _computed(bm, seq)
        elif op == "free":
            bm.free(seq)
        elif op == "forget":
            for s in seqs:
                bm.free(s)
            bm.forget_contents()
        gained, lost = bm.report()
        assert not set(gained) & set(lost)
        mirror = (mirror | set(gained)) - set(lost)
        heads = {s.block_hashes[i] for s in seqs for i in range(min(2, len(s.block_hashes)))}
        assert mirror == bm.shallow and bm.shallow <= set(bm.by_hash)
        assert heads & set(bm.by_hash) <= bm.shallow  # a name's depth is its chain's


@settings(max_examples=300, deadline=None)
@given(window=st.integers(1, 20), block_size=st.sampled_from([1, 4, 16]),
       prefix_cache=st.booleans(), margin=st.integers(0, 8),
       grow=st.lists(st.integers(1, 9), min_size=1, max_size=30))
def test_blocks_a_window_has_passed_are_given_back_and_the_rest_kept(
        window, block_size, prefix_cache, margin, grow):
    """Every block holding a position the next query may see (from num_computed - margin -
    window + 1 on) stays; the ones before go back, named ones to the prefix cache; a sequence
    holds about window + margin tokens of blocks however long it grows."""
    bm = BlockManager(64, block_size, prefix_cache, window=window)
    seq = _seq(0, [1, 2, 3])
    for n in grow:
        seq.token_ids += [7] * n
        assert bm.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        bm.name_full_blocks(seq)
        bm.release_outside_window(seq, margin)
        first_seen = max(0, seq.num_computed_tokens - margin - window + 1)
        gone = first_seen // block_size
        assert seq.released_blocks == gone
        assert all(b != bm.null_block for b in seq.block_table[gone:])
        check_blocks(bm, [seq])
        live = len(seq.block_table) - gone
        assert live <= bm.blocks_for(window + margin) + 1
    if prefix_cache and len(seq.block_table) <= 64:  # nothing evicted yet: what went back is
        # still there for a sequence with the same start
        assert len(bm.lookup(seq.token_ids)) == (seq.num_tokens - 1) // block_size
    bm.free(seq)
    check_blocks(bm, [seq])
    assert bm.num_free == 64


def test_without_a_window_nothing_is_given_back():
    bm = BlockManager(8, 4)
    seq = _seq(0, list(range(20)))
    assert bm.allocate(seq, 20)
    seq.num_computed_tokens = 20
    bm.release_outside_window(seq)
    assert bm.null_block not in seq.block_table and bm.num_free == 3
