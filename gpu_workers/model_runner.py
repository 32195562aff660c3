"""ModelRunner.run(): one step plan in, one sampled token per finished chunk out."""

from __future__ import annotations

import os
import time

import torch

from gpu_workers.llama import AttentionMetadata, LlamaModel
from gpu_workers.sampler import SamplingBatch, sample
from surge.protocol import (
    PREVIOUS_TOKEN,
    SamplingParams,
    ScheduledSeq,
    StepPlan,
    TokenLogprobs,
)


def kv_cache_shape(model: LlamaModel, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """This rank's cache: the KV heads its attention holds."""
    cfg = model.cfg
    kv_heads = model.layers[0].attn.num_kv_heads
    return (cfg.num_layers, 2, num_blocks, block_size, kv_heads, cfg.head_dim)


def kv_block_bytes(model: LlamaModel, block_size: int, dtype: torch.dtype) -> int:
    shape = kv_cache_shape(model, 1, block_size)
    return int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()


def _padded(tables: list[list[int]]) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64).view(
        len(tables), width)


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_cache = torch.zeros(kv_cache_shape(model, num_blocks, block_size), dtype=dtype,
                                    device=device)
        # What the last step sampled, for plans made before it finished (PREVIOUS_TOKEN).
        self.last_sampled: dict[int, int] = {}
        # The last step's model forward (with the LM head), without input building and sampling;
        # on CUDA only the launches, as nothing waits for the device here.
        self.forward_s = 0.0

    def warm_up(self) -> None:
        """A prefill and a decode step on throwaway blocks, so the first real request does not
        pay for first-call allocations and kernel selection."""
        n = min(2 * self.block_size, self.kv_cache.shape[2] * self.block_size - 1)
        table = list(range(-(-(n + 1) // self.block_size)))
        params = SamplingParams(max_tokens=2, temperature=1.0, top_p=0.9)
        tokens = [i % self.model.cfg.vocab_size for i in range(1, n + 1)]
        prefill = ScheduledSeq(0, tokens, 0, table, True, params, 0)
        self.run(StepPlan(-2, [prefill]))
        decode = ScheduledSeq(0, [PREVIOUS_TOKEN], n, table, True, params, 0)
        self.run(StepPlan(-1, [decode]))
        self.last_sampled = {}

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The sampled token of each sequence with sample=True, in plan order, and its
        logprobs where asked for (an empty list when nobody asked)."""
        # Decode tokens (one per sequence) first, so attention can treat them as one batch.
        seqs = sorted(plan.seqs, key=lambda s: len(s.token_ids) != 1)
        input_ids, positions, meta = self._prepare(seqs)
        started = time.perf_counter()
        hidden = self.model(input_ids, positions, meta, self.kv_cache)
        ends = torch.tensor([len(s.token_ids) for s in seqs]).cumsum(0) - 1
        want = [i for i, s in enumerate(seqs) if s.sample]
        if not want:
            self.last_sampled = {}
            self.forward_s = time.perf_counter() - started
            return [], []
        picked = [seqs[i] for i in want]
        if self.model.tp.rank == 0:
            logits = self.model.logits(hidden[ends[want].to(self.device)])
            self.forward_s = time.perf_counter() - started
            batch = SamplingBatch.build(
                picked, [s.start_pos + len(s.token_ids) for s in picked],
                [self._history(s) for s in picked], logits.shape[1], self.device)
            tokens_t, logprobs = sample(logits, batch)
        else:  # rank 0 samples for the group
            tokens_t, logprobs = torch.empty(len(picked), dtype=torch.int64,
                                             device=self.device), []
        self.model.tp.broadcast(tokens_t)
        tokens = tokens_t.tolist()
        # Back to plan order, which is how the scheduler reads them.
        self.last_sampled = {s.seq_id: t for s, t in zip(picked, tokens, strict=True)}
        order = {s.seq_id: i for i, s in enumerate(picked)}
        in_plan = [order[s.seq_id] for s in plan.seqs if s.sample]
        return [tokens[i] for i in in_plan], [logprobs[i] for i in in_plan] if logprobs else []

    def _history(self, s: ScheduledSeq) -> list[int] | None:
        """Every token of s up to the one being sampled, for penalties (None without them)."""
        if s.history is None:
            return None
        fed = [t if t != PREVIOUS_TOKEN else self.last_sampled[s.seq_id] for t in s.token_ids]
        return s.history[: s.start_pos] + fed

    def _prepare(self, seqs: list[ScheduledSeq]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        lens = [len(s.token_ids) for s in seqs]
        num_decode = sum(1 for n in lens if n == 1)
        last = self.last_sampled
        input_ids = torch.tensor(
            [t if t != PREVIOUS_TOKEN else last[s.seq_id] for s in seqs for t in s.token_ids],
            dtype=torch.int64)
        starts = torch.tensor([s.start_pos for s in seqs], dtype=torch.int64)
        counts = torch.tensor(lens, dtype=torch.int64)
        seq_index = torch.repeat_interleave(torch.arange(len(seqs)), counts)
        offsets = torch.arange(len(input_ids)) - torch.repeat_interleave(counts.cumsum(0) - counts,
                                                                         counts)
        positions = starts[seq_index] + offsets
        tables = _padded([s.block_table for s in seqs])
        slot_mapping = tables[seq_index, positions // bs] * bs + positions % bs
        context_lens = starts + counts
        decode_tables = [s.block_table for s in seqs[:num_decode]]
        shared = 0
        if self.device.type == "cpu" and num_decode > 1:  # cascade attention is CPU-only
            # Blocks at the head of every decoding sequence's table (a shared prompt), full in
            # each, with at least one token of its own left after them.
            shared = min(len(os.path.commonprefix(decode_tables)),
                         (int(context_lens[:num_decode].min()) - 1) // bs)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            num_decode=num_decode,
            # Padded per group: decode attention reads every listed block, so keep it narrow.
            decode_block_tables=_padded(decode_tables).to(dev),
            decode_context_lens=context_lens[:num_decode].to(dev),
            decode_shared_blocks=shared,
            prefill_block_tables=_padded([s.block_table for s in seqs[num_decode:]]).to(dev),
            prefill_query_start=torch.tensor([0, *lens[num_decode:]]).cumsum(0).to(dev),
            prefill_context_lens=context_lens[num_decode:].to(dev),
            prefill_max_query_len=max(lens[num_decode:], default=0),
        )
        return input_ids.to(dev), positions.to(dev), meta
