"""OpenAI request bodies, decoded and range-checked by msgspec."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
MaxTokens = Annotated[int, Meta(ge=1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Meta(ge=0)]


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class _Common(Struct, kw_only=True):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI clients send extras."""

    model: str | None = None
    temperature: Temperature | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # surge extensions
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None


class CompletionRequest(_Common, kw_only=True):
    # A string, a list of token ids, or a batch of either.
    prompt: str | list[str | TokenId | list[TokenId]]
    max_tokens: MaxTokens | None = 16


class TextPart(Struct, kw_only=True):
    type: Literal["text"]
    text: str


class ChatMessage(Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
