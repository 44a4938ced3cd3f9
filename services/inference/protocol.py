"""Wire models of the inference API: OpenAI's requests (chat, completions), vLLM's adapter
routes and Tandem's model registration. The responses and stream chunks (OpenAI's, shared with
the clients that read them) are services/common/openai_wire.py's."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
)

from services.common.bounds import (
    JSON_SCHEMA,
    NAME_CHARS,
    TEXT_CHARS,
    JsonData,
    JsonSchema,
    Name,
    Text,
)

# The limits of a generation request (docs/contracts.md, "Request limits"): vLLM's and OpenAI's
# where they have one (top_logprobs 20, logit_bias 300 pairs in [-100, 100]), else a bound far
# past any real use that still keeps one request from holding the engine (a probe's six million
# stop_token_ids stalled every tenant for 46 s).
MAX_TOKENS = 1 << 20  # a static ceiling; the served model's context window is checked by the engine
MAX_MESSAGES = 2048
MAX_PARTS = 2048  # content parts of one message, tool calls of one message
MAX_TOOLS = 128
MAX_CHOICES = 16  # n and best_of
MAX_LOGPROBS = 20
MAX_STOP = 16  # stop strings
STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = (1 << 31) - 1
MAX_LOGIT_BIAS = 300
MAX_PROMPT_ITEMS = 2048  # prompts of one completion request
MAX_PROMPT_TOKENS = 1 << 20  # token ids of one prompt
MAX_SEED = (1 << 63) - 1

TokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKEN_ID)]
StopString = Annotated[str, Field(max_length=STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]
# logit_bias keys are token ids as JSON object keys (strings): serving.py reads them as ints
LogitBias = Annotated[
    dict[Annotated[str, Field(max_length=12)], Annotated[float, Field(strict=True, ge=-100.0, le=100.0)]],
    Field(max_length=MAX_LOGIT_BIAS),
]


def _min_tokens(description: str) -> Any:
    return Field(None, ge=0, le=MAX_TOKENS, description=description)


def _within_max_tokens(value: int | None, info: ValidationInfo) -> int | None:
    limit = info.data.get("max_completion_tokens") or info.data.get("max_tokens")
    if value is not None and limit is not None and value > limit:
        raise ValueError(f"must be at most max_tokens ({limit})")
    return value


class _Open(BaseModel):
    # Clients send fields we do not use (user, metadata, ...): accepted and ignored.
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: StrictBool = False


class ChatMessage(_Open):
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: Text | Annotated[list[JsonData], Field(max_length=MAX_PARTS)] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[JsonData], Field(max_length=MAX_PARTS)] | None = None
    tool_call_id: Name | None = None


class _Sampling(_Open):
    model: str = Field(..., min_length=1, max_length=NAME_CHARS)
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(
        None, ge=-1, le=MAX_TOKEN_ID, description="Tandem/vLLM extension: keep the k most likely tokens."
    )
    n: StrictInt = Field(1, ge=1, le=MAX_CHOICES)
    stop: Stop = Field(None, description=f"At most {MAX_STOP} strings of at most {STOP_CHARS} characters.")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    seed: StrictInt | None = Field(None, ge=-MAX_SEED - 1, le=MAX_SEED)
    presence_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: LogitBias | None = Field(
        None, description=f"At most {MAX_LOGIT_BIAS} token ids, each biased by -100 to 100."
    )
    user: Name | None = None
    ignore_eos: StrictBool = Field(
        False, description="vLLM extension: keep generating past the end-of-text token."
    )
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description=f"vLLM extension: at most {MAX_STOP_TOKEN_IDS} token ids that end generation."
    )
    repetition_penalty: StrictFloat | None = Field(
        None,
        gt=0.0,
        le=10.0,
        description="vLLM extension: divide seen tokens' positive logits (multiply negative ones) by this.",
    )
    min_p: StrictFloat | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="vLLM extension: drop tokens less likely than min_p times the most likely one.",
    )
    guided_grammar: str | None = Field(
        None,
        max_length=TEXT_CHARS,
        description="vLLM extension: an EBNF grammar (xgrammar's dialect) the output must follow.",
    )


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKENS)
    min_tokens: StrictInt | None = _min_tokens(
        "vLLM extension (passed on by the remote engine): at most max_completion_tokens or max_tokens."
    )
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[JsonSchema], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Annotated[Any, JSON_SCHEMA] = None
    parallel_tool_calls: StrictBool | None = None
    response_format: JsonSchema | None = None

    _min_tokens = field_validator("min_tokens")(_within_max_tokens)


class CompletionRequest(_Sampling):
    prompt: (
        Text
        | Annotated[list[Text], Field(max_length=MAX_PROMPT_ITEMS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(max_length=MAX_PROMPT_ITEMS)]
    )
    max_tokens: StrictInt | None = Field(16, ge=1, le=MAX_TOKENS)
    min_tokens: StrictInt | None = _min_tokens(
        "vLLM extension (passed on by the remote engine): at most max_tokens."
    )
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: str | None = Field(None, max_length=TEXT_CHARS)
    best_of: StrictInt | None = Field(None, ge=1, le=MAX_CHOICES)
    response_format: JsonSchema | None = Field(
        None, description="Tandem/vLLM extension: json_object or json_schema, as on chat."
    )

    _min_tokens = field_validator("min_tokens")(_within_max_tokens)


TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class LoadLoraRequest(BaseModel):
    lora_name: str = Field(..., min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:/-]+$")
    lora_path: str = Field(..., min_length=1, max_length=4096)
    tenant: str | None = Field(
        None,
        max_length=64,
        pattern=TENANT_PATTERN,
        description="Tandem: the tenant the adapter belongs to (none: shared).",
    )
    base: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="Tandem: a registered model the adapter applies to (none: the served base model).",
    )


class UnloadLoraRequest(BaseModel):
    lora_name: str = Field(..., min_length=1, max_length=200)


class RegisterModelRequest(BaseModel):
    name: str = Field(..., min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:/-]+$")
    path: str = Field(..., min_length=1, max_length=4096)
    tenant: str | None = Field(
        None,
        max_length=64,
        pattern=TENANT_PATTERN,
        description="The tenant the model belongs to (none: shared).",
    )


class UnregisterModelRequest(BaseModel):
    name: str = Field(..., min_length=1, max_length=200)


class Capabilities(BaseModel):
    """What this server can serve; the trainer checks a ``publish`` job against it."""

    engine: str
    adapters: bool
    max_lora_rank: int | None
    register_models: bool
    # the torch engine's forward plan (engine/plan.py): paths, kernels and the reason for each
    forward_plan: dict[str, Any] | None = None


# --- adapter and model management answers ----------------------------------------------------------


class AdapterLoaded(BaseModel):
    status: Literal["loaded"] = "loaded"
    lora_name: str
    lora_path: str
    tenant: str | None = None


class AdapterUnloaded(BaseModel):
    status: Literal["unloaded"] = "unloaded"
    lora_name: str


class ModelUnregistered(BaseModel):
    status: Literal["unregistered"] = "unregistered"
    name: str


class ModelDeleted(BaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: Literal[True] = True
    kind: Literal["adapter", "registered"]
