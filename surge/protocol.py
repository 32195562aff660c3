"""Every message that crosses a process boundary, defined once (msgpack-encoded msgspec Structs)."""

from __future__ import annotations

import msgspec
from msgspec import Struct

from surge.config import OverloadConfig, SchedulerConfig, TenantConfig
from surge.config_frontend import PoolConfig, RoutingConfig

# ---- frontend -> scheduler (ZeroMQ) ----


class SamplingParams(Struct, kw_only=True, array_like=True):
    """Validated by the frontend; each field is applied by the worker's sampler except
    max_tokens, min_tokens and stop_token_ids, which the scheduler checks."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0  # stop tokens are banned until this many tokens are out
    logprobs: int | None = None  # None: off; k: the chosen token's logprob and the top k
    # None: the scheduler draws one, so every sequence samples from a fixed (seed, position) stream.
    seed: int | None = None
    # The frontend folds EOS in here unless ignore_eos, so the scheduler needs no tokenizer.
    stop_token_ids: list[int] = []
    # None: off; k: each prompt token's logprob (the first's excepted) and the top k there, for
    # completions' echo with logprobs. Such a prompt is computed whole, not from the prefix cache.
    prompt_logprobs: int | None = None

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


class EngineRequest(Struct, tag=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    tenant: str = "default"
    priority: int | None = None  # lower is served first (vLLM's convention); None: the tenant's
    timeout_s: float | None = None  # must start within this; None: the tenant's default
    # Structured output: the grammar engine's text for the constraint (surge.grammar); the
    # frontend has checked it, rank 0's worker enforces it.
    grammar: str | None = None


class EngineRequests(Struct, tag=True):
    """Every engine request of one API request (its prompts times n), in one message: the
    scheduler admits them as a unit, all or none."""

    requests: list[EngineRequest]


class AbortRequest(Struct, tag=True):
    request_ids: list[str]


class BreakerState(Struct, tag=True):
    """The frontend's circuit breaker, for `surge admin stats`: sent when it changes."""

    state: str  # "closed" | "open" | "half-open"
    rejected: int  # requests it has turned away, in all


# ---- scheduler -> frontend (ZeroMQ) ----


class TokenLogprobs(Struct, array_like=True):
    """The sampled token's log-probability under the model, and the most likely tokens'."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class RequestOutput(Struct, array_like=True):
    """Tokens for a request. The first output of an accepted request is an empty one (the
    acknowledgement), so the frontend can answer a refusal with its status before streaming."""

    request_id: str
    new_token_ids: list[int]
    # None while running; "stop" | "length" when done; "abort" | "error" when ended otherwise.
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked for
    status: int = 503  # with "error": the HTTP status it means (400: the request's own fault)
    retry_after: float | None = None  # with a 429 or 503: seconds until a retry may succeed
    # On an acknowledgement: how the degradation ladder changed the request (e.g.
    # "max_tokens=64"), which the client is told in a header.
    degraded: str | None = None
    # On the first output with tokens, for traces: seconds from arrival to the first step,
    # and the prompt tokens the prefix cache held.
    queued_s: float | None = None
    cached_tokens: int | None = None
    # On the first output with tokens, when asked for: the prompt's tokens after its first.
    prompt_logprobs: list[TokenLogprobs] | None = None


class EngineOutputs(Struct, tag=True):
    outputs: list[RequestOutput]


class EngineStats(Struct, tag=True, kw_only=True):
    """Running totals from the scheduler, sent about once a second while it works."""

    time: float
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    steps: int
    scheduled_tokens: int
    generated_tokens: int
    worker_compute_s: float
    worker_wait_s: float
    worker_forward_s: float = 0.0
    spec_proposed_tokens: int = 0  # speculative tokens sent for verification
    spec_accepted_tokens: int = 0  # of which the model agreed with
    spec_verifications: int = 0  # sequence-steps that verified proposals
    queued_tokens: int = 0  # prompt tokens of the waiting requests
    congested: bool = False  # see scheduler/overload.py
    overload_level: int = 0  # degradation steps in force
    degraded_requests: int = 0  # capped or refused by the ladder, in all
    breaker: str = "closed"  # the frontend's circuit breaker (BreakerState)
    breaker_rejected: int = 0
    # For autoscalers (scheduler/signals.py): the queue's drain time at the measured rate,
    # requests arrived a second, the best rates served lately, and the arrival rate forecast
    # at each horizon (seconds ahead, as text) in requests a second.
    queue_drain_s: float = 0.0
    arrival_rate: float = 0.0
    capacity_tokens_s: float = 0.0
    capacity_requests_s: float = 0.0
    forecast: dict[str, float] = {}
    replica: int = 0  # the data-parallel replica these figures are of


class EngineHealth(Struct, tag=True):
    """Sent when the engine turns unhealthy (a restarted worker died again before it served a
    step) and when it serves again (problem None)."""

    problem: str | None
    replica: int = 0


class EngineFault(Struct, tag=True):
    """A worker died (or a step failed): the frontend's circuit breaker counts these, and
    its router keeps new requests off the replica until it reports stats again."""

    reason: str
    replica: int = 0


class LiveSettings(Struct, tag=True, kw_only=True):
    """The live parameters the frontend applies too (its breaker, router and global limits),
    sent when `surge admin set` changes any of them."""

    overload: OverloadConfig
    routing: RoutingConfig
    pools: dict[str, PoolConfig]
    tenants: dict[str, TenantConfig]
    scheduler: SchedulerConfig


class PrefixReport(Struct, tag=True):
    """Prefix-cache names a replica gained and lost among the first route_prefix_blocks
    blocks of a chain since its last report (data parallelism only: the router's view)."""

    replica: int
    gained: list[bytes]
    lost: list[bytes]


class EngineReady(Struct, tag=True, kw_only=True):
    """Sent once the workers have loaded the model and the KV cache is sized."""

    num_blocks: int
    block_size: int
    description: str
    replica: int = 0


# ---- scheduler -> workers (shared-memory ring, broadcast) ----


# In ScheduledSeq.token_ids: "the token you sampled for this sequence in the previous step",
# which the scheduler does not know yet when it plans the next step ahead.
PREVIOUS_TOKEN = -1


class ScheduledSeq(Struct, array_like=True):
    seq_id: int
    token_ids: list[int]  # the tokens this step feeds, starting at position start_pos
    start_pos: int
    block_table: list[int]
    # This chunk reaches the sequence's last token, so a new token is sampled (with num_draft,
    # one per proposed token plus one).
    sample: bool
    sampling: SamplingParams
    seed: int
    ban_stop_tokens: bool = False  # min_tokens not reached yet
    # With penalties: every token known before start_pos, and how many of them are the prompt.
    history: list[int] | None = None
    num_prompt_tokens: int = 0
    # Speculative decoding: the last num_draft token_ids are proposals, verified in this step;
    # after it, the worker's draft model proposes `propose` tokens for the next one.
    num_draft: int = 0
    propose: int = 0
    # On the first chunk of a constrained sequence's computation (new, or recomputed after
    # preemption or a worker restart): its grammar, and its output tokens so far, which the
    # worker's new matcher consumes first. The worker keeps the matcher until `released`.
    grammar: str | None = None
    grammar_tokens: list[int] = []
    # With prompt logprobs: the prompt tokens this chunk's rows predict, row by row from its
    # first (the next chunk's first token too), which the sampling rank scores.
    scores: list[int] = []


class StepPlan(Struct, tag=True):
    step_id: int
    seqs: list[ScheduledSeq]
    released: list[int] = []  # constrained sequences that ended: their matchers can go


class Shutdown(Struct, tag=True):
    pass


# ---- workers -> scheduler (ZeroMQ) ----


class WorkerReady(Struct, tag=True, kw_only=True):
    rank: int
    num_blocks: int
    block_size: int
    description: str
    kernels: str = ""  # the kernel backend and why (kernels.for_device)
    generation: int = 0  # of workers: each replacement of the group is the next one
    window: int = 0  # how far back every layer attends, in tokens (0: some layer sees all)


class SeqResult(Struct, array_like=True):
    """What a step sampled for one sequence."""

    token_ids: list[int]  # the proposals it accepted, if any, then the model's own next token
    logprobs: list[TokenLogprobs] | None = None  # one per token, when asked for
    draft: list[int] = []  # the draft model's proposals for the next step
    # The output constraint failed (the grammar engine gave up on this sequence): it ends.
    grammar_error: str | None = None


class StepResult(Struct, tag=True):
    step_id: int
    # One per ScheduledSeq with sample=True, by seq_id rather than by position, so that no
    # side depends on the order in which the other walks the plan.
    seqs: dict[int, SeqResult]
    compute_s: float = 0.0  # the worker's time on this step
    forward_s: float = 0.0  # of which the model forward (see ModelRunner.forward_s)
    wait_s: float = 0.0  # how long the worker waited for this plan after the previous step
    # The `scores` of the plan's sequences: one per token, by seq_id.
    prompt_logprobs: dict[int, list[TokenLogprobs]] = {}


class WorkerFailed(Struct, tag=True):
    rank: int
    error: str
    # False: a new worker is (or may be) on its way, so the scheduler waits and recomputes;
    # True: the supervisor gave up, so every request ends with an error.
    fatal: bool = False
    generation: int = 0  # of the worker that failed (see WorkerReady)


# ---- admin (`surge admin`, the supervisor) -> scheduler (ZeroMQ request/reply) ----


class AdminRequest(Struct, tag=True):
    command: str  # "get" | "set" | "reload" (a set whose tables replace the old) | "stats"
    values: dict[str, str] = {}


class AdminReply(Struct, tag=True):
    ok: bool
    message: str
    values: dict[str, object] = {}


FrontendMessage = EngineRequests | AbortRequest | BreakerState
SchedulerMessage = (EngineOutputs | EngineReady | EngineStats | EngineHealth | EngineFault
                    | LiveSettings | PrefixReport)
WorkerMessage = WorkerReady | StepResult | WorkerFailed
PlanMessage = StepPlan | Shutdown

encode = msgspec.msgpack.Encoder().encode
