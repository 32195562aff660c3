"""OpenAI request bodies, decoded and range-checked by msgspec."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=10.0)]
MaxTokens = Annotated[int, Meta(ge=1)]
COMPLETION_MAX_TOKENS = 16
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Meta(ge=0)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
Choices = Annotated[int, Meta(ge=1, le=16)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
# An empty stop string would match nowhere: refused rather than ignored.
StopString = Annotated[str, Meta(min_length=1)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=4)]
# Per-request lists are bounded, so one request cannot make a step too large to stage: OpenAI's
# own cap for logit_bias, and far more stop ids than any tokenizer has end tokens.
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 256


class StreamOptions(Struct, kw_only=True, forbid_unknown_fields=True):
    # null: not given (as vLLM's Optional fields read it)
    include_usage: bool | None = None
    # vLLM's: with include_usage, every chunk carries the usage so far (guidellm asks for it).
    continuous_usage_stats: bool | None = None


class JsonSchemaFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern="^[A-Za-z0-9_-]+$")]  # OpenAI's
    description: str | None = None
    # OpenAI names it `schema`; the Struct attribute cannot shadow msgspec's own names.
    json_schema: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None  # constrained output is always strict


class ResponseFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's newer form of the guided_* fields (one of them)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


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
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None  # None: as top_p; else 0 (off)
    min_p: Probability = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    # Lower is served first; None: the tenant's default priority.
    priority: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)] | None = None
    # Seconds the request may wait in the queue before it starts; None: the tenant's default.
    timeout: Annotated[float, Meta(ge=0.001)] | None = None
    # Structured output (server/structured.py): OpenAI's, and vLLM's extensions.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Meta(min_length=1)] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # false: the result cache (server/result_cache.py) neither answers nor keeps this request.
    cache: bool = True


class CompletionRequest(_Common, kw_only=True):
    # A string, a list of token ids, or a batch of either.
    prompt: str | list[str | TokenId | list[TokenId]]
    # Absent or null: COMPLETION_MAX_TOKENS, OpenAI's default (vLLM reads null as "what the
    # context allows", with which one request could hold a slot for minutes). 0: with echo,
    # the prompt alone.
    max_tokens: Annotated[int, Meta(ge=0)] | None = None
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    echo: bool = False
    # Only best_of == n: surge does not rank extra candidates (a larger one is refused).
    best_of: Choices | None = None


class TextPart(Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="text"):
    text: str


class ImagePart(Struct, kw_only=True, tag_field="type", tag="image_url"):
    """Decoded only to be refused by name (server/translate.py): the models are text only."""

    image_url: Any = None


class AudioPart(Struct, kw_only=True, tag_field="type", tag="input_audio"):
    input_audio: Any = None


ContentPart = TextPart | ImagePart | AudioPart


class FunctionCall(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    parsed_arguments: Any = None  # the client's own reading of arguments (parse())


class ToolCall(Struct, kw_only=True, forbid_unknown_fields=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | Annotated[list[ContentPart], Meta(min_length=1)] | None = None
    name: str | None = None  # passed to the chat template, which may render it
    # An assistant turn as OpenAI's responses carry it (an agent loop appends
    # `message.model_dump()`): refusal, audio and function_call null, annotations none, as what
    # they would hold has no place in the chat template; parsed, the client's own reading of
    # content (chat.completions.parse).
    refusal: None = None
    annotations: Annotated[list[Any], Meta(max_length=0)] | None = None
    audio: None = None
    function_call: None = None
    parsed: Any = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers


class FunctionDef(Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern="^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # the arguments are always held to the schema when constrained


class Tool(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str


class ToolChoiceNamed(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    # Tool calling (server/tools.py)
    tools: Annotated[list[Tool], Meta(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceNamed | None = None
    parallel_tool_calls: bool | None = None

    @property
    def many_tool_calls(self) -> bool:
        """Whether an answer may hold several calls (parallel_tool_calls absent: yes, as OpenAI)."""
        return self.parallel_tool_calls is not False


class TokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's POST /tokenize: a prompt, or messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    add_generation_prompt: bool = True
    # False by default: /v1/completions adds no special tokens, and the count must be its count.
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[TokenId]
