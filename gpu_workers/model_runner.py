"""ModelRunner: a step plan is prepared (inputs packed and sent to the device), launched (model
forward and sampling queued) and finished (the sampled ids read back). The worker prepares step
N+1 while step N computes; run() does the three in a row."""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from msgspec import Struct

from gpu_workers import host_memory
from gpu_workers.draft import DraftModel, shares_layers
from gpu_workers.graphs import DecodeGraphs
from gpu_workers.llama import AttentionMetadata, LlamaModel
from gpu_workers.pipeline import StageLink
from gpu_workers.sampler import SamplingBatch, sample, token_logprobs
from shm.staging import Staging
from surge.grammar import Matchers
from surge.protocol import (
    PREVIOUS_TOKEN,
    SamplingParams,
    ScheduledSeq,
    SeqResult,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from surge.step_size import step_words

# Rows of prompt logprobs scored at once: their float32 logits, log-softmax and a copy take
# about 3 x 256 x vocabulary x 4 bytes (150 MB for a 49k vocabulary, 800 MB for 256k).
_SCORE_ROWS = 256


def kv_cache_shape(model: LlamaModel, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """This rank's cache: its pipeline stage's layers, the KV heads its attention holds."""
    cfg = model.cfg
    kv_heads = model.layers[0].attn.num_kv_heads
    return (len(model.layers), 2, kv_heads, num_blocks, block_size, cfg.head_dim)


def kv_block_bytes(model: LlamaModel, block_size: int, dtype: torch.dtype) -> int:
    shape = kv_cache_shape(model, 1, block_size)
    return int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()


def _padded(tables: list[list[int]]) -> np.ndarray:
    out = np.zeros((len(tables), max((len(t) for t in tables), default=0)), dtype=np.int64)
    for row, table in zip(out, tables, strict=True):
        row[: len(table)] = table
    return out


class Step(Struct, kw_only=True):
    """A plan whose inputs are on their way to the device (views into the staging buffer)."""

    plan: StepPlan
    slot: int
    seqs: list[ScheduledSeq]  # decode rows first
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # Tokens of the previous step, not known when this plan was made: input_ids[patch_at]
    # takes the previous step's sampled[patch_from] on the device.
    patch_at: torch.Tensor
    patch_from: torch.Tensor
    logit_rows: torch.Tensor  # the hidden state each sampled token comes from
    # The rows that sample, in logit_rows order: a sequence with proposals has one per
    # proposed token plus one, from first_row[seq_id] on; sample_positions: each row's token's.
    picked: list[ScheduledSeq]
    first_row: dict[int, int]
    sample_positions: list[int]
    sampling: SamplingBatch | None
    proposers: Proposers | None  # sequences the draft model proposes for after this step
    # Prompts scored for their logprobs: (seq_id, its first row, the tokens its rows predict,
    # top k).
    scores: list[tuple[int, int, list[int], int]] = []


class Proposers(Struct, kw_only=True):
    """Where the draft model starts for each sequence that asked: after its newest token,
    which depends on how many of its proposals this step accepts (found on the device)."""

    seq_ids: list[int]
    first_row: torch.Tensor  # [S] its first sampling row
    num_draft: torch.Tensor  # [S] proposals it verifies in this step
    max_draft: int
    context: torch.Tensor  # [S] its tokens through this step, proposals included
    tables: torch.Tensor  # [S, W] block tables, with room for the proposals to come
    k: int


class Launched(Struct, kw_only=True):
    step: Step
    # Host copies (being filled on CUDA) of the sampled ids, which rows accepted their
    # proposed token (None: no proposals) and the draft model's proposals (None: none asked).
    tokens: torch.Tensor | None
    accepted: torch.Tensor | None = None
    drafts: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    logprobs: list[TokenLogprobs | None] = []
    prompt_logprobs: dict[int, list[TokenLogprobs]] = {}


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, *, graphs_max_batch: int = 0,
                 capture_graphs: bool = False, draft: LlamaModel | None = None,
                 fixed_order: bool = False, matchers: Matchers | None = None) -> None:
        """graphs_max_batch > 0: decode-only batches up to that size take the padded graph
        path (captured as CUDA graphs when capture_graphs). draft: speculative decoding's
        draft model (see gpu_workers.draft). fixed_order: --deterministic attention.
        matchers: structured output's grammar matchers (rank 0, which samples)."""
        self.model = model
        self.matchers = matchers
        self.fixed_order = fixed_order
        self.block_size = block_size
        self.device = device
        # One block past the scheduler's: where graph padding rows write.
        self.kv_cache = host_memory.zeros(kv_cache_shape(model, num_blocks + 1, block_size),
                                          dtype, device)
        self.draft = None
        if draft is not None and shares_layers(draft, model):
            self.draft = DraftModel(draft, self.kv_cache[: draft.cfg.num_layers], block_size,
                                    mirrors=False)
        elif draft is not None:
            self.draft = DraftModel(draft, host_memory.zeros(
                kv_cache_shape(draft, num_blocks + 1, block_size), dtype, device),
                block_size, mirrors=True)
        self.staging = Staging(device)
        self.graphs = (DecodeGraphs(model, self.kv_cache, block_size, num_blocks,
                                    graphs_max_batch, capture_graphs)
                       if graphs_max_batch else None)
        # The last step sampled: on the device for the next step's inputs, on the host (once
        # finished) for penalties; and which row each sequence's token is in.
        self.sampled = torch.zeros(0, dtype=torch.int64, device=device)
        self.sampled_rows: dict[int, int] = {}
        self.last_sampled: dict[int, int] = {}
        self.host_tokens = torch.empty(1 << 16, dtype=torch.int64,
                                       pin_memory=device.type == "cuda")
        # Pipeline stages: only the last stage's rank 0 samples (and reports the tokens); the
        # others hand their hidden states on (link). local: the warm-up, run by each stage alone.
        stage = model.stage
        self.samples = model.tp.rank == 0 and stage.last
        self.link = StageLink(stage) if stage.size > 1 else None
        self.local = False
        # The last step's model forward (with the LM head), without input building and sampling;
        # on CUDA only the launches, as nothing waits for the device here.
        self.forward_s = 0.0

    def warm_up(self, tokens: int = 0) -> None:
        """A prefill of `tokens` (two blocks at least) and a decode step on throwaway blocks, so
        the first real request does not pay for first-call allocations and kernel selection: a
        step's whole token budget also compiles the Triton kernels whose variant follows the
        batch's size (the MoE row blocks)."""
        n = min(max(tokens, 2 * self.block_size), self.kv_cache.shape[3] * self.block_size - 1)
        table = list(range(-(-(n + 1) // self.block_size)))
        params = SamplingParams(max_tokens=2, temperature=1.0, top_p=0.9)
        ids = [i % self.model.cfg.vocab_size for i in range(1, n + 1)]
        prefill = ScheduledSeq(0, ids, 0, table, True, params, 0)
        self.local = True
        self.run(StepPlan(-2, [prefill]))
        # A stage of a pipeline does not see the tokens the last one samples.
        fed = PREVIOUS_TOKEN if self.link is None else 1
        decode = ScheduledSeq(0, [fed], n, table, True, params, 0)
        self.run(StepPlan(-1, [decode]))
        self.local = False
        self.sampled_rows, self.last_sampled = {}, {}

    def run(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(self.prepare(plan)))

    def prepare(self, plan: StepPlan) -> Step:
        """Pack the plan's inputs and start their copy to the device."""
        # Decode tokens (one per sequence) first, so attention can treat them as one batch.
        seqs = sorted(plan.seqs, key=lambda s: len(s.token_ids) != 1)
        bs, stage = self.block_size, self.staging
        slot = stage.begin(step_words(plan, sampling=self.samples))
        lens = np.fromiter((len(s.token_ids) for s in seqs), np.int64, len(seqs))
        nd = int((lens == 1).sum())
        starts = np.fromiter((s.start_pos for s in seqs), np.int64, len(seqs))
        ids = np.fromiter((t for s in seqs for t in s.token_ids), np.int64, int(lens.sum()))
        seq_of = np.repeat(np.arange(len(seqs)), lens)
        patch_at = np.flatnonzero(ids == PREVIOUS_TOKEN)
        patch_from = [self.sampled_rows[seqs[i].seq_id] for i in seq_of[patch_at]]
        ids[patch_at] = 0
        firsts = np.cumsum(lens) - lens
        positions = starts[seq_of] + np.arange(len(ids)) - firsts[seq_of]
        tables = [s.block_table for s in seqs]
        all_tables = _padded(tables)
        widths = np.fromiter((len(t) for t in tables), np.int64, len(tables))
        slots = all_tables[seq_of, positions // bs] * bs + positions % bs
        context = starts + lens
        shared = 0
        if self.device.type == "cpu" and nd > 1 and not self.fixed_order:  # CPU-only cascade
            # Blocks at the head of every decoding sequence's table (a shared prompt), full in
            # each, with at least one token of its own left after them.
            shared = min(len(os.path.commonprefix(tables[:nd])),
                         (int(context[:nd].min()) - 1) // bs)
        prefill_lens = lens[nd:]
        meta = AttentionMetadata(
            slot_mapping=stage.add(slots),
            num_decode=nd,
            # Padded per group: decode attention reads every listed block, so keep it narrow.
            decode_block_tables=stage.add(all_tables[:nd, : widths[:nd].max(initial=0)]),
            decode_context_lens=stage.add(context[:nd]),
            decode_shared_blocks=shared,
            prefill_block_tables=stage.add(all_tables[nd:, : widths[nd:].max(initial=0)]),
            prefill_query_start=stage.add(np.concatenate([[0], np.cumsum(prefill_lens)])),
            prefill_context_lens=stage.add(context[nd:]),
            prefill_max_query_len=int(prefill_lens.max(initial=0)),
            fixed_order=self.fixed_order,
        )
        # A sequence samples at its last token and, with proposals, before each proposed
        # token too (each such row verifies the token that follows it).
        last_rows = np.cumsum(lens) - 1
        rows: list[int] = []
        picked: list[ScheduledSeq] = []
        sample_positions: list[int] = []
        drafts: list[int] = []
        first_row: dict[int, int] = {}
        for i, s in enumerate(seqs):
            if s.sample:
                nd, end = s.num_draft, int(last_rows[i])
                first_row[s.seq_id] = len(rows)
                rows += range(end - nd, end + 1)
                picked += [s] * (nd + 1)
                sample_positions += range(int(context[i]) - nd, int(context[i]) + 1)
                drafts += [*s.token_ids[len(s.token_ids) - nd :], -1] if nd else [-1]
        self.sampled_rows = {s.seq_id: first_row[s.seq_id] + s.num_draft
                             for s in seqs if s.sample}
        sampling = None
        if picked and self.samples:
            sampling = SamplingBatch.build(
                picked, sample_positions, self.model.cfg.vocab_size, self.device, stage.add,
                drafts if any(s.num_draft for s in seqs) else None)
        step = Step(plan=plan, slot=slot, seqs=seqs, input_ids=stage.add(ids),
                    positions=stage.add(positions), meta=meta, patch_at=stage.add(patch_at),
                    patch_from=stage.add(patch_from), logit_rows=stage.add(np.array(rows)),
                    picked=picked, first_row=first_row, sample_positions=sample_positions,
                    sampling=sampling, proposers=self._proposers(seqs, first_row, context,
                                                                 all_tables),
                    scores=[(s.seq_id, int(firsts[i]), s.scores, s.sampling.prompt_logprobs or 0)
                            for i, s in enumerate(seqs) if s.scores])
        stage.send()
        return step

    def _proposers(self, seqs: list[ScheduledSeq], first_row: dict[int, int],
                   context: np.ndarray, tables: np.ndarray) -> Proposers | None:
        which = [i for i, s in enumerate(seqs) if s.propose]
        if self.draft is None or not which:
            return None
        stage = self.staging
        num_draft = np.fromiter((seqs[i].num_draft for i in which), np.int64, len(which))
        return Proposers(
            seq_ids=[seqs[i].seq_id for i in which],
            first_row=stage.add(np.array([first_row[seqs[i].seq_id] for i in which])),
            num_draft=stage.add(num_draft), max_draft=int(num_draft.max()),
            context=stage.add(context[which]), tables=stage.add(tables[which]),
            k=max(seqs[i].propose for i in which))

    @torch.inference_mode()
    def launch(self, step: Step) -> Launched:
        """Queue the forward and the sampling; start reading the sampled ids back. Call after
        the previous step's finish() (penalties read the tokens it sampled)."""
        self.staging.wait(step.slot)
        started = time.perf_counter()
        if self.matchers is not None:
            self._start_matchers(step.plan)
        if len(step.patch_at):
            step.input_ids[step.patch_at] = self.sampled[step.patch_from]
        meta = step.meta
        if (self.graphs is not None and meta.num_decode == len(step.seqs)
                and self.graphs.fits(*meta.decode_block_tables.shape)):
            hidden = self.graphs.run(step.input_ids, step.positions, meta.slot_mapping,
                                     meta.decode_block_tables, meta.decode_context_lens)
        else:
            hidden = self.model(step.input_ids, step.positions, meta, self.kv_cache,
                                self._received(len(step.input_ids)))
        if self.draft is not None:
            self.draft.mirror(step.input_ids, step.positions, meta)
        if not self.model.stage.last or (self.link is not None and not self.samples):
            # A stage before the last hands its states on; the last one's other ranks are
            # done (with stages, nobody feeds a sampled token back: plans carry real ones).
            if self.link is not None and not self.model.stage.last and not self.local:
                self.link.send(hidden)
            self.staging.release(step.slot)
            self.forward_s = time.perf_counter() - started
            return Launched(step=step, tokens=None)
        if not step.picked:
            self.staging.release(step.slot)
            self.forward_s = time.perf_counter() - started
            return Launched(step=step, tokens=None, prompt_logprobs=self._score(hidden, step))
        logprobs: list[TokenLogprobs | None] = []
        accepted = None
        if step.sampling is not None:  # rank 0 samples for the group
            logits = self.model.logits(hidden[step.logit_rows])
            self.forward_s = time.perf_counter() - started
            # On CUDA the forward is only queued yet: the masks are filled while it computes.
            self._constrain(step, step.sampling)
            # A row verifying a proposal sees the history up to its own position.
            full = {s.seq_id: self._history(s) for s in step.picked if s.history is not None}
            step.sampling.add_penalties(
                step.picked, [full[s.seq_id][:position] if s.seq_id in full else None
                              for s, position in zip(step.picked, step.sample_positions,
                                                     strict=True)],
                logits.shape[1], self.device)
            tokens, accepted, logprobs = sample(logits, step.sampling, self.model.ops)
        else:
            tokens = torch.empty(len(step.picked), dtype=torch.int64, device=self.device)
        if self.link is None:  # the other ranks patch PREVIOUS_TOKEN from them
            self.model.tp.broadcast(tokens)
        self.sampled = tokens
        drafts = None if step.proposers is None else self._propose(step.proposers, tokens,
                                                                    accepted)
        # After the sampling is queued: on CUDA scoring waits for the device (.tolist()).
        scored = self._score(hidden, step)
        self.staging.release(step.slot)
        if self.device.type != "cuda":
            return Launched(step=step, tokens=tokens, accepted=accepted, drafts=drafts,
                            logprobs=logprobs, prompt_logprobs=scored)
        host = [None if t is None else t.to("cpu", non_blocking=True)
                for t in (accepted, drafts)]
        tokens_host = self.host_tokens[: len(tokens)]
        tokens_host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return Launched(step=step, tokens=tokens_host, accepted=host[0], drafts=host[1],
                        ready=ready, logprobs=logprobs, prompt_logprobs=scored)

    def _score(self, hidden: torch.Tensor, step: Step) -> dict[int, list[TokenLogprobs]]:
        """On the sampling rank: each scored prompt token's logprob at the row before it, and
        the top k there; the LM head runs on _SCORE_ROWS rows at a time (a whole chunk's
        vocabulary-wide logits would not be bounded)."""
        out: dict[int, list[TokenLogprobs]] = {}
        if not self.samples:
            return out
        for seq_id, first, targets, k in step.scores:
            found: list[TokenLogprobs | None] = []
            for at in range(0, len(targets), _SCORE_ROWS):
                part = targets[at : at + _SCORE_ROWS]
                logits = self.model.logits(hidden[first + at : first + at + len(part)])
                found += token_logprobs(logits, torch.tensor(part, device=self.device),
                                        [k] * len(part))
            out[seq_id] = [lp for lp in found if lp is not None]
            assert len(out[seq_id]) == len(targets)  # every row asks, so none is None
        return out

    def _received(self, num_tokens: int) -> torch.Tensor | None:
        """The previous stage's [2, T, hidden] states for this step (None on the first)."""
        if self.link is None or self.model.stage.first:
            return None
        cfg, dtype = self.model.cfg, self.kv_cache.dtype
        if self.local:  # the warm-up: any states will do
            return torch.zeros((2, num_tokens, cfg.hidden_size), dtype=dtype,
                               device=self.device)
        return self.link.recv(num_tokens, cfg.hidden_size, dtype, self.device)

    def _propose(self, p: Proposers, tokens: torch.Tensor, accepted: torch.Tensor | None
                 ) -> torch.Tensor:
        """[S, k] draft proposals, each from its sequence's newest token: the one sampled
        after its accepted proposals (counted on the device, without a sync)."""
        assert self.draft is not None
        taken = torch.zeros_like(p.first_row)
        if accepted is not None and p.max_draft:
            offsets = torch.arange(p.max_draft, device=self.device)
            rows = (p.first_row[:, None] + offsets).clamp(max=len(accepted) - 1)
            agree = accepted[rows] & (offsets < p.num_draft[:, None])
            taken = agree.long().cumprod(dim=1).sum(dim=1)
        newest = tokens[p.first_row + taken]
        return self.draft.propose(newest, p.context - p.num_draft + taken, p.tables, p.k)

    def finish(self, launched: Launched) -> StepResult:
        """Wait for the sampled ids: each sampling sequence's new tokens."""
        if launched.ready is not None:
            launched.ready.synchronize()
        step = launched.step
        if launched.tokens is None and self.link is not None:  # another rank reports it,
            # unless this one samples (a step that only scores prompts)
            return StepResult(step.plan.step_id, {}, prompt_logprobs=launched.prompt_logprobs)
        tokens = [] if launched.tokens is None else launched.tokens.tolist()
        accepted = None if launched.accepted is None else launched.accepted.tolist()
        logprobs = launched.logprobs
        drafts: dict[int, list[int]] = {}
        if launched.drafts is not None and step.proposers is not None:
            drafts = dict(zip(step.proposers.seq_ids, launched.drafts.tolist(), strict=True))
        seqs: dict[int, SeqResult] = {}
        self.last_sampled = {}
        for s in step.seqs:
            if not s.sample:
                continue
            first, taken = step.first_row[s.seq_id], 0
            while accepted and taken < s.num_draft and accepted[first + taken]:
                taken += 1
            rows = slice(first, first + taken + 1)
            asked = bool(logprobs) and logprobs[first] is not None
            seqs[s.seq_id] = SeqResult(tokens[rows], logprobs[rows] if asked else None,
                                       drafts.get(s.seq_id, []))
            self.last_sampled[s.seq_id] = tokens[first + taken]
            if self.matchers is not None:
                self.matchers.advance(s.seq_id, tokens[rows])
                seqs[s.seq_id].grammar_error = self.matchers.failed.pop(s.seq_id, None)
        return StepResult(step.plan.step_id, seqs, prompt_logprobs=launched.prompt_logprobs)

    def _start_matchers(self, plan: StepPlan) -> None:
        """Matchers come and go in launch(), after the previous step's finish() advanced them."""
        assert self.matchers is not None
        self.matchers.release(plan.released)
        for s in plan.seqs:
            if s.grammar is not None:
                self.matchers.start(s.seq_id, s.grammar, s.grammar_tokens)

    def _constrain(self, step: Step, sampling: SamplingBatch) -> None:
        """The token bitmasks of the constrained rows (a draft token's row too)."""
        if self.matchers is None or not self.matchers.by_seq:
            return
        rows = [(s.seq_id, step.first_row[s.seq_id], s.token_ids[len(s.token_ids) - s.num_draft:])
                for s in step.seqs if s.sample and s.seq_id in self.matchers]
        if not rows:
            return
        masked, mask = self.matchers.bitmask(rows)
        sampling.grammar_rows = torch.tensor(masked, dtype=torch.int64, device=self.device)
        sampling.grammar_mask = torch.from_numpy(mask).to(self.device, non_blocking=True)

    def _history(self, s: ScheduledSeq) -> list[int] | None:
        """Every token of s up to the one being sampled, for penalties (None without them)."""
        if s.history is None:
            return None
        fed = [t if t != PREVIOUS_TOKEN else self.last_sampled[s.seq_id] for t in s.token_ids]
        return s.history[: s.start_pos] + fed
