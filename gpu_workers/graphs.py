"""CUDA graphs for decode-only steps: one captured per batch size at start, each batch padded up
to the next captured size. Padding rows write their K/V to a scratch block no sequence owns and
attend to one token of it. Without CUDA the same padded path runs eagerly (so tests cover it)."""

from __future__ import annotations

import torch

from gpu_workers.llama import AttentionMetadata, LlamaModel


def graph_sizes(max_batch: int) -> list[int]:
    """Small sizes one by one doubling, then every 16: padding wastes at most 15 rows."""
    return sorted({s for s in (1, 2, 4, 8, *range(16, max_batch + 1, 16)) if s <= max_batch}
                  | {max_batch})


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int,
                 scratch_block: int, max_batch: int, capture: bool) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.sizes = graph_sizes(max_batch)
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        dev = kv_cache.device
        max_blocks = -(-model.cfg.max_position_embeddings // block_size)
        # Static inputs: a graph reads these addresses; each step copies its values in.
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros_like(self.input_ids)
        self.slots = torch.zeros_like(self.input_ids)
        self.context_lens = torch.ones_like(self.input_ids)
        self.tables = torch.full((max_batch, max_blocks), scratch_block, dtype=torch.int64,
                                 device=dev)
        self.no_prefill = torch.zeros(1, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    def fits(self, batch: int, width: int) -> bool:
        return batch <= self.sizes[-1] and width <= self.tables.shape[1]

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata.decode_only(self.slots[:size], self.tables[:size],
                                             self.context_lens[:size], self.no_prefill)
        return self.model(self.input_ids[:size], self.positions[:size], meta, self.kv_cache)

    def _pad(self, n: int, size: int) -> None:
        self.input_ids[n:size] = 0
        self.positions[n:size] = 0
        self.slots[n:size] = self.scratch_slot
        self.context_lens[n:size] = 1
        self.tables[n:size] = self.scratch_block

    def _capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            self._pad(0, size)
            for _ in range(2):  # compile and tune every kernel outside the capture
                self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only batch of n (see fits())."""
        n, width = tables.shape
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slots)
        self.context_lens[:n].copy_(context_lens)
        self.tables[:n, :width].copy_(tables)
        self._pad(n, size)
        if graph := self.graphs.get(size):
            graph.replay()
            return self.outputs[size][:n]
        return self._forward(size)[:n]
