"""OpenAI's Responses API on the wire, as a server writes it: the request both services read
(``POST /v1/responses``) and the ``response`` object with its output items (messages with
``output_text`` parts, ``function_call`` and ``mcp_call`` items), shared by the inference service
and the agent's facade. How a request becomes a chat request is services/common/responses_input.py;
the stream's typed events are services/common/responses_stream.py."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from services.common.bounds import (
    METADATA_PAIRS,
    NAME_CHARS,
    TEXT_CHARS,
    JsonData,
    JsonSchema,
    MetadataKey,
    MetadataValue,
    Name,
)
from services.common.jsonsafe import JsonObject
from services.common.openai_wire import WireModel


def new_id(prefix: str) -> str:
    """``resp_``, ``msg_``, ``fc_``... followed by 32 hex digits (OpenAI's ids are opaque)."""
    return f"{prefix}_{uuid.uuid4().hex}"


RESPONSE_ID_PATTERN = r"^resp_[0-9a-f]{32}$"

# A request's limits (docs/contracts.md, "Request limits"): metadata as OpenAI bounds it, input
# items and tools far past real use (a probe stored 10,000 input items and 8,000 metadata pairs).
MAX_INPUT_ITEMS = 2048
MAX_TOOLS = 128
# a static ceiling; the model's context window is checked where the server knows it
MAX_OUTPUT_TOKENS = 1 << 20


class ResponseRequest(BaseModel):
    """``POST /v1/responses``. Fields this server does not use (``reasoning``, ``include``,
    ``truncation``, ``service_tier``...) are accepted and ignored, as on chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(..., min_length=1, max_length=NAME_CHARS)
    input: (
        Annotated[str, Field(max_length=TEXT_CHARS)]
        | Annotated[list[JsonData], Field(max_length=MAX_INPUT_ITEMS)]
    ) = Field(
        ...,
        description="Text (one user message), or a list of at most "
        f"{MAX_INPUT_ITEMS} input items (messages, function calls and outputs).",
    )
    instructions: str | None = Field(
        None, max_length=TEXT_CHARS, description="A system message before the input (not carried on)."
    )
    tools: Annotated[list[JsonSchema], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description=f"At most {MAX_TOOLS}."
    )
    tool_choice: Name | JsonSchema | None = None
    parallel_tool_calls: StrictBool | None = None
    text: JsonSchema | None = Field(None, description="``format``: text, json_object or json_schema.")
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    max_output_tokens: StrictInt | None = Field(
        None, ge=1, le=MAX_OUTPUT_TOKENS, description="At most the model's context window."
    )
    stream: StrictBool = False
    store: StrictBool = Field(True, description="Keep the response (GET it, or continue from it).")
    previous_response_id: str | None = Field(
        None,
        max_length=NAME_CHARS,
        description="Continue from a stored response of the caller's tenant: its input and output come first.",
    )
    metadata: dict[MetadataKey, MetadataValue] | None = Field(
        None,
        max_length=METADATA_PAIRS,
        description=f"At most {METADATA_PAIRS} pairs: keys of at most 64 characters, values of at most 512.",
    )
    user: Name | None = None


# --- the response and its output items -----------------------------------------------------------


class FileCitation(WireModel):
    """A source the text cites: ``file_id`` the document's id, ``filename`` its title,
    ``index`` the character offset in the text where it is cited."""

    type: Literal["file_citation"] = "file_citation"
    file_id: str
    filename: str
    index: int


class OutputText(WireModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[FileCitation] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(WireModel):
    id: str
    type: Literal["message"] = "message"
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(WireModel):
    """A call for the client to run; its result comes back as a ``function_call_output`` input item."""

    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str
    name: str
    arguments: str


class McpCallItem(WireModel):
    """A call the server made to a registered MCP server's tool, with its output (or error)."""

    id: str
    type: Literal["mcp_call"] = "mcp_call"
    server_label: str
    name: str
    arguments: str
    output: str | None = None
    error: str | None = None


OutputItem = OutputMessage | FunctionCallItem | McpCallItem


class InputTokensDetails(WireModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(WireModel):
    reasoning_tokens: int = 0


class ResponseUsage(WireModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of_chat(cls, usage: dict[str, Any] | None) -> ResponseUsage:
        """From chat completions' ``usage`` (prompt/completion/total tokens)."""
        usage = usage or {}
        prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        return cls(input_tokens=prompt, output_tokens=completion, total_tokens=prompt + completion)


class ResponseError(WireModel):
    code: str
    message: str


class IncompleteDetails(WireModel):
    reason: Literal["max_output_tokens", "content_filter"]


ResponseStatus = Literal["completed", "failed", "in_progress", "incomplete"]


class ResponseObject(WireModel):
    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    text: JsonObject = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | JsonObject = "auto"
    tools: list[JsonObject] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = True

    @classmethod
    def started(cls, body: ResponseRequest, **extra: Any) -> ResponseObject:
        """The response as it begins (``in_progress``, no output yet), echoing the request."""
        return cls(
            id=new_id("resp"),
            created_at=int(time.time()),
            status="in_progress",
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=body.model,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id,
            temperature=body.temperature,
            text=body.text or {"format": {"type": "text"}},
            tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
            tools=body.tools or [],
            top_p=body.top_p,
            user=body.user,
            metadata=body.metadata or {},
            store=body.store,
            **extra,
        )

    def output_text(self) -> str:
        return "".join(
            p.text for item in self.output if isinstance(item, OutputMessage) for p in item.content
        )


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True
