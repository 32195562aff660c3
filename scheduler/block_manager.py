"""Fixed-size KV blocks: a free pool and each sequence's block table."""

from __future__ import annotations

from collections import deque

from scheduler.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks seq needs so that its first num_tokens tokens have slots."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to cover num_tokens; the caller checked blocks_needed first."""
        need = self.blocks_needed(seq, num_tokens)
        assert need <= self.num_free, f"{seq} needs {need} blocks, {self.num_free} free"
        seq.block_table.extend(self.free_blocks.popleft() for _ in range(need))

    def free(self, seq: Sequence) -> None:
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []
