"""Every message that crosses a process boundary, defined once (msgpack-encoded msgspec Structs)."""

from __future__ import annotations

import msgspec
from msgspec import Struct

# ---- frontend -> scheduler (ZeroMQ) ----


class SamplingParams(Struct, kw_only=True, array_like=True):
    max_tokens: int
    temperature: float = 1.0
    # None: the scheduler draws one, so every sequence samples from a fixed (seed, position) stream.
    seed: int | None = None
    # The frontend folds EOS in here unless ignore_eos, so the scheduler needs no tokenizer.
    stop_token_ids: list[int] = []


class EngineRequest(Struct, tag=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float


class AbortRequest(Struct, tag=True):
    request_ids: list[str]


# ---- scheduler -> frontend (ZeroMQ) ----


class RequestOutput(Struct, array_like=True):
    request_id: str
    new_token_ids: list[int]
    # None while running; "stop" | "length" when done; "abort" | "error" when ended otherwise.
    finish_reason: str | None = None
    error: str | None = None


class EngineOutputs(Struct, tag=True):
    outputs: list[RequestOutput]


class EngineReady(Struct, tag=True, kw_only=True):
    """Sent once the workers have loaded the model and the KV cache is sized."""

    num_blocks: int
    block_size: int
    description: str


# ---- scheduler -> workers (shared-memory ring, broadcast) ----


class ScheduledSeq(Struct, array_like=True):
    seq_id: int
    token_ids: list[int]  # the tokens this step feeds, starting at position start_pos
    start_pos: int
    block_table: list[int]
    sample: bool  # this chunk reaches the sequence's last token, so a new token is sampled
    temperature: float
    seed: int


class StepPlan(Struct, tag=True):
    step_id: int
    seqs: list[ScheduledSeq]


class Shutdown(Struct, tag=True):
    pass


# ---- workers -> scheduler (ZeroMQ) ----


class WorkerReady(Struct, tag=True, kw_only=True):
    rank: int
    num_blocks: int
    block_size: int
    description: str


class StepResult(Struct, tag=True):
    step_id: int
    sampled_token_ids: list[int]  # one per ScheduledSeq with sample=True, in plan order


class WorkerFailed(Struct, tag=True):
    rank: int
    error: str


FrontendMessage = EngineRequest | AbortRequest
SchedulerMessage = EngineOutputs | EngineReady
WorkerMessage = WorkerReady | StepResult | WorkerFailed
PlanMessage = StepPlan | Shutdown

encode = msgspec.msgpack.Encoder().encode
