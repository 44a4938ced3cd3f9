"""OpenAI's response and stream-chunk pieces as a server writes them, shared by the services that
answer in OpenAI's shape (the inference service, the agent's facade): the base models that decide
which fields reach the JSON, usage, tool calls and stream deltas. Each service builds its own
envelope (``chat.completion``, ``chat.completion.chunk``) from these, with the fields it adds.

The client's view of the same wire (lenient, for reading any compatible upstream) is
services/common/openai_stream.py."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer


class WireModel(BaseModel):
    """A response model: every field is in the JSON, ``null`` included, as OpenAI sends it."""


class SparseModel(WireModel):
    """A response model whose fields named in ``_omit_unset`` stay out of the JSON unless they
    were given: a stream delta carries only what changed, and ``usage`` is in every chunk only
    with ``stream_options.include_usage``. (A serializer of its own costs a Python call per
    instance, so only these models have one, not the many logprob entries.)"""

    _omit_unset: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in self._omit_unset - self.model_fields_set:
            data.pop(name, None)
        return data


class Usage(WireModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class FunctionCall(WireModel):
    name: str
    arguments: str


class ToolCall(WireModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDelta(SparseModel):
    # an upstream's own fields pass through (remote engine)
    model_config = ConfigDict(extra="allow")
    name: str | None = None
    arguments: str | None = None
    _omit_unset = frozenset({"name", "arguments"})


class ToolCallDelta(SparseModel):
    """One streamed piece of a tool call: the first carries ``id``, ``type`` and the name,
    the later ones argument fragments (OpenAI's chunk shape)."""

    model_config = ConfigDict(extra="allow")
    index: int = 0
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None
    _omit_unset = frozenset({"index", "id", "type", "function"})


class ChatDelta(SparseModel):
    """What one chunk adds to a choice: the role first, then content or tool-call pieces."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    _omit_unset = frozenset({"role", "content", "tool_calls"})
