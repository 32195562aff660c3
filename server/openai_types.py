"""OpenAI request bodies, decoded and range-checked by msgspec."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=10.0)]
MaxTokens = Annotated[int, Meta(ge=1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Meta(ge=0)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
Choices = Annotated[int, Meta(ge=1, le=16)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
Stop = str | Annotated[list[str], Meta(max_length=4)]
# Per-request lists are bounded, so one request cannot make a step too large to stage: OpenAI's
# own cap for logit_bias, and far more stop ids than any tokenizer has end tokens.
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 256


class StreamOptions(Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False


class _Common(Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields both endpoints share. A field surge does not implement is refused (400, naming
    it), never ignored: a client asking for tools or a response format must not get plain text
    back as if it had been honoured."""

    model: str | None = None
    n: Choices = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None  # None: the model's generation_config.json, else 1
    seed: Seed | None = None
    stop: Stop | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: Annotated[dict[str, Bias], Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions, as in vLLM
    top_k: Annotated[int, Meta(ge=-1)] | None = None  # None: as top_p; else 0 (off)
    min_p: Probability = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    # Lower is served first; None: the tenant's default priority.
    priority: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)] | None = None
    # Seconds the request may wait in the queue before it starts; None: the tenant's default.
    timeout: Annotated[float, Meta(ge=0.001)] | None = None


class CompletionRequest(_Common, kw_only=True):
    # A string, a list of token ids, or a batch of either.
    prompt: str | list[str | TokenId | list[TokenId]]
    max_tokens: MaxTokens | None = 16
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    echo: bool = False


class TextPart(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessage(Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
