"""Fixed-size KV blocks with reference counts and a prefix cache.

A full block is named by a hash chained over its tokens and its parent block's hash, so equal
names mean equal prefixes. A sequence starting with a cached prefix takes references on those
blocks instead of recomputing them. Blocks nobody references but whose contents are named stay
cached, and are evicted least recently used first when a fresh block is needed.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection

from scheduler.sequence import Sequence
from surge.prefix_hash import block_hash

__all__ = ["BlockManager", "block_hash"]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True,
                 window: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        # How far back every layer's attention looks, in tokens (0: some layer sees it all).
        self.window = window
        # What a given-back entry of a block table points to: the worker's scratch block, one
        # past ours, which attention may read but masks.
        self.null_block = num_blocks
        self.ref_count = [0] * num_blocks
        self.unnamed: deque[int] = deque(range(num_blocks))  # free, contents meaningless
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free but named, LRU first
        self.name_of: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # block -> (hash, tokens)
        self.by_hash: dict[bytes, int] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0
        # For the data-parallel router (PrefixReport): names of blocks within the first
        # report_depth of their chain, and those gained and lost since the last report.
        self.report_depth = 0
        self.shallow: set[bytes] = set()
        self.gained: set[bytes] = set()
        self.lost: set[bytes] = set()

    @property
    def num_free(self) -> int:
        return len(self.unnamed) + len(self.evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_to_allocate(self, seq: Sequence, num_tokens: int,
                           hits: Collection[int] = ()) -> int:
        """Free blocks seq would take to have slots for its first num_tokens tokens, starting on
        its cached prefix `hits` if it holds no blocks yet: the new ones, and the hits nobody
        holds (they are counted as free, and leave the free lists when taken)."""
        reused_free = sum(1 for b in hits if self.ref_count[b] == 0)
        held = len(seq.block_table) + len(hits)
        return max(0, self.blocks_for(num_tokens) - held) + reused_free

    # ---- prefix cache ----

    def lookup(self, token_ids: list[int]) -> list[int]:
        """Cached blocks holding the longest prefix of token_ids (no references taken). At least
        one token is always left to compute, since the step must produce its logits."""
        if not self.prefix_cache:
            return []
        hits: list[int] = []
        parent = None
        bs = self.block_size
        for start in range(0, len(token_ids) - 1 - (len(token_ids) - 1) % bs, bs):
            tokens = tuple(token_ids[start : start + bs])
            h = block_hash(parent, tokens)
            block = self.by_hash.get(h)
            if block is None or self.name_of[block][1] != tokens:
                break
            hits.append(block)
            parent = h
        return hits

    def name_full_blocks(self, seq: Sequence) -> None:
        """Name every block of seq that its computed tokens now fill, so others can reuse it."""
        if not self.prefix_cache:
            return
        bs = self.block_size
        # Only tokens we know: a step planned ahead computes a token not sampled yet.
        full = min(seq.num_computed_tokens, seq.num_tokens) // bs
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self.by_hash and block not in self.name_of:
                self.by_hash[h] = block
                self.name_of[block] = (h, tokens)
                if i < self.report_depth:
                    self.shallow.add(h)
                    self.gained.add(h)
                    self.lost.discard(h)

    def _unname(self, h: bytes) -> None:
        if h in self.shallow:
            self.shallow.remove(h)
            self.lost.add(h)
            self.gained.discard(h)

    def report(self) -> tuple[list[bytes], list[bytes]]:
        """Names gained and lost near the head of a chain since the last call."""
        gained, lost = list(self.gained), list(self.lost)
        self.gained.clear()
        self.lost.clear()
        return gained, lost

    def forget_contents(self) -> None:
        """The KV cache was lost (a new worker): no block holds anything reusable now."""
        assert not any(self.ref_count), "forget_contents with blocks still held"
        self.unnamed.extend(self.evictable)
        self.evictable.clear()
        self.name_of.clear()
        self.by_hash.clear()
        for h in list(self.shallow):
            self._unname(h)

    # ---- allocation ----

    def _take(self, block: int) -> None:
        if self.ref_count[block] == 0:
            self.evictable.pop(block, None)
        self.ref_count[block] += 1

    def _fresh_block(self) -> int:
        if self.unnamed:
            block = self.unnamed.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            h, _ = self.name_of.pop(block)
            del self.by_hash[h]
            self._unname(h)
        self.ref_count[block] = 1
        return block

    def allocate(self, seq: Sequence, num_tokens: int, hits: Collection[int] = ()) -> bool:
        """Give seq slots for its first num_tokens tokens if enough blocks are free; if not,
        change nothing and say False. A sequence holding no blocks yet is being admitted: it
        starts on `hits` (see lookup), those tokens computed, and counts toward the hit rate."""
        assert not (hits and seq.block_table), "only an admission starts on cached blocks"
        if self.blocks_to_allocate(seq, num_tokens, hits) > self.num_free:
            return False
        if not seq.block_table:
            for block in hits:
                self._take(block)
            seq.block_table = list(hits)
            seq.block_hashes = [self.name_of[b][0] for b in hits]
            seq.num_computed_tokens = len(hits) * self.block_size
            self.queried_tokens += seq.num_tokens
            self.hit_tokens += seq.num_computed_tokens
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        seq.block_table.extend(self._fresh_block() for _ in range(need))
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's blocks past its first num_tokens tokens (slots of rejected
        speculative tokens); they hold no named contents, so they go back unnamed."""
        keep = self.blocks_for(num_tokens)
        assert keep >= len(seq.block_hashes), "trimming named blocks"
        for block in reversed(seq.block_table[keep:]):
            self._release(block)
        del seq.block_table[keep:]

    def release_outside_window(self, seq: Sequence, margin: int = 0) -> None:
        """Give back the blocks at the head of seq that no query of it can see from now on, a
        sliding window having passed them in every layer. margin: tokens counted as computed
        that may yet be taken back (rejected proposals)."""
        if not self.window:
            return
        # The next query sits at num_computed_tokens - margin at the earliest, and sees the
        # window - 1 keys before it.
        first_seen = seq.num_computed_tokens - margin - self.window + 1
        gone = max(0, first_seen) // self.block_size
        if self.prefix_cache:  # named before they go, so they stay cached for others
            gone = min(gone, len(seq.block_hashes))
        for i in range(seq.released_blocks, gone):
            self._release(seq.block_table[i])
            seq.block_table[i] = self.null_block
        seq.released_blocks = max(seq.released_blocks, gone)

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; a block nobody holds stays cached if it is named."""
        # The tail is evicted before the shared head.
        for block in reversed(seq.block_table[seq.released_blocks:]):
            self._release(block)
        seq.block_table = []
        seq.block_hashes = []
        seq.released_blocks = 0

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            if block in self.name_of:
                self.evictable[block] = None
            else:
                self.unnamed.append(block)
