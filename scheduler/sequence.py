"""One request's state as the scheduler sees it."""

from __future__ import annotations

from enum import Enum

from scheduler.tenants import Tenant
from surge.protocol import SamplingParams, TokenLogprobs


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int],
                 sampling: SamplingParams, seed: int, arrival_time: float, tenant: Tenant,
                 priority: int = 0, deadline: float | None = None,
                 grammar: str | None = None) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # Tokens whose K/V are in the cache; after preemption this drops to 0 (recompute).
        self.num_computed_tokens = 0
        # Tokens sampled by steps still in flight: known to the worker, not yet to us.
        self.num_pending = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # prefix-cache names of the full blocks, in order
        # Leading entries of block_table given back: no attention window reaches them anymore.
        self.released_blocks = 0
        self.sampling = sampling
        self.seed = seed
        self.arrival_time = arrival_time
        self.tenant = tenant
        self.priority = priority  # lower is more urgent
        self.deadline = deadline  # when it must have started by, else it ends with an error
        self.first_scheduled: float | None = None
        self.cached_tokens = 0  # of the prompt, found in the prefix cache when first scheduled
        self.grammar = grammar  # structured output (see ScheduledSeq.grammar)
        self.grammar_sent = False  # to the workers, for the computation under way
        # With prompt logprobs: those scored so far (prompt position p's at p - 1).
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.status = Status.WAITING
        # Speculative decoding (see scheduler.speculation).
        self.draft: list[int] = []  # the draft model's proposals for the next step
        self.spec_inflight = False  # a step in flight verifies or proposes: its length unknown
        self.spec_score = 1.0  # recent share of proposals accepted
        self.spec_paused_until = 0  # step id before which it does not speculate
        self.spec_pauses = 0  # pauses in a row (each twice as long as the one before)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def remaining_output(self) -> int:
        return self.sampling.max_tokens - self.num_output_tokens

    @property
    def wants_more(self) -> bool:
        """Whether another token may be sampled beyond those known and pending."""
        return self.num_output_tokens + self.num_pending < self.sampling.max_tokens

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
