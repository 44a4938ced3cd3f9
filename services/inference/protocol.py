"""Wire models of the inference API: OpenAI's requests (chat, completions), vLLM's adapter
routes and Tandem's model registration. The responses and stream chunks (OpenAI's, shared with
the clients that read them) are services/common/openai_wire.py's."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    # Clients send fields we do not use (user, metadata, ...): accepted and ignored.
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool = False


class ChatMessage(_Open):
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _Sampling(_Open):
    model: str = Field(..., min_length=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(
        None, ge=-1, description="Tandem/vLLM extension: keep the k most likely tokens."
    )
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating past the end-of-text token.")
    stop_token_ids: list[int] | None = Field(
        None, description="vLLM extension: token ids that end generation."
    )
    repetition_penalty: float | None = Field(
        None,
        description="vLLM extension: divide seen tokens' positive logits (multiply negative ones) by this.",
    )
    min_p: float | None = Field(
        None, description="vLLM extension: drop tokens less likely than min_p times the most likely one."
    )
    guided_grammar: str | None = Field(
        None, description="vLLM extension: an EBNF grammar (xgrammar's dialect) the output must follow."
    )


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = Field(
        None, description="Tandem/vLLM extension: json_object or json_schema, as on chat."
    )


TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class LoadLoraRequest(BaseModel):
    lora_name: str = Field(..., min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:/-]+$")
    lora_path: str = Field(..., min_length=1)
    tenant: str | None = Field(
        None, pattern=TENANT_PATTERN, description="Tandem: the tenant the adapter belongs to (none: shared)."
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
    path: str = Field(..., min_length=1)
    tenant: str | None = Field(
        None, pattern=TENANT_PATTERN, description="The tenant the model belongs to (none: shared)."
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
