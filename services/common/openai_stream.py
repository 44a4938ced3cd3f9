"""The one reader of server-sent events and of OpenAI's stream chunks, for every client in the stack.

:func:`iter_sse` / :func:`aiter_sse` turn the lines of a ``text/event-stream`` body into events
(``event:`` and ``data:`` fields, an event ending at a blank line, ``:`` comments skipped, as the
WHATWG spec has it). :func:`openai_chunks` reads OpenAI's chat or text completion stream into the
typed chunk models below: ``data: [DONE]`` ends it, an ``{"error": ...}`` object or a malformed
chunk raises :class:`UpstreamBroken`, and so does a stream that ends without ``[DONE]`` (the
server died or the connection dropped: such an answer is cut short, not complete).

The models are the client's view of the wire: lenient (unknown fields kept, most fields
optional), since the upstream may be Tandem, vLLM, OpenAI or another compatible server.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common.upstream import UpstreamBroken, error_message

DONE = "[DONE]"


@dataclass
class SSEEvent:
    data: str
    event: str = "message"


@dataclass
class _SSEParser:
    data: list[str] = field(default_factory=list)
    event: str = ""

    def feed(self, line: str) -> SSEEvent | None:
        """One line (without its newline); the event it completes, if any."""
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self.data.append(value)
        elif name == "event":
            self.event = value
        return None

    def flush(self) -> SSEEvent | None:
        out = SSEEvent("\n".join(self.data), self.event or "message") if self.data else None
        self.data, self.event = [], ""
        return out


def iter_sse(lines: Iterable[str]) -> Iterator[SSEEvent]:
    parser = _SSEParser()
    for line in lines:
        if (ev := parser.feed(line)) is not None:
            yield ev
    if (ev := parser.flush()) is not None:
        yield ev


async def aiter_sse(lines: AsyncIterable[str]) -> AsyncIterator[SSEEvent]:
    parser = _SSEParser()
    async for line in lines:
        if (ev := parser.feed(line)) is not None:
            yield ev
    if (ev := parser.flush()) is not None:
        yield ev


# -- OpenAI's wire shapes, as a client reads them ------------------------------------------------


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(_Open):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class FunctionCall(_Open):
    name: str = ""
    arguments: str = ""


class ToolCall(_Open):
    id: str = ""
    type: str = "function"
    function: FunctionCall = Field(default_factory=FunctionCall)


class FunctionCallDelta(_Open):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Open):
    """A piece of a streamed tool call: the first names it, the next add to its arguments."""

    id: str | None = None
    type: str | None = None
    index: int = 0
    function: FunctionCallDelta | None = None


class TopLogprob(_Open):
    """A token and its log-probability (one of the likeliest at a position, or the one chosen)."""

    token: str
    logprob: float


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(_Open):
    content: list[ChatLogprob] | None = None


class CompletionLogprobs(_Open):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float] | None] | None = None


class _Choice(_Open):
    index: int = 0
    finish_reason: str | None = None


class _Said(_Open):
    """What a message or a message's delta says."""

    content: str | None = None


class Delta(_Said):
    role: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Choice):
    delta: Delta = Field(default_factory=Delta)
    logprobs: ChatLogprobs | None = None

    @property
    def text(self) -> str:
        return self.delta.content or ""


class CompletionChunkChoice(_Choice):
    text: str = ""
    logprobs: CompletionLogprobs | None = None


class _Envelope(_Open):
    id: str = ""
    object: str = ""
    created: int = 0
    model: str = ""
    usage: Usage | None = None


class ChatCompletionChunk(_Envelope):
    choices: list[ChatChunkChoice] = []

    def has_output(self) -> bool:
        """Anything beyond the opening role chunk: text, a call, a finish or the usage."""
        return self.usage is not None or any(
            c.text or c.delta.tool_calls or c.finish_reason or c.logprobs for c in self.choices
        )


class CompletionChunk(_Envelope):
    choices: list[CompletionChunkChoice] = []

    def has_output(self) -> bool:
        return self.usage is not None or any(c.text or c.finish_reason or c.logprobs for c in self.choices)


class ChatMessage(_Said):
    role: str = "assistant"
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Choice):
    message: ChatMessage = Field(default_factory=ChatMessage)


class ChatCompletion(_Envelope):
    choices: list[ChatChoice] = []

    @property
    def message(self) -> ChatMessage:
        """The first choice's message (an empty one when there is no choice)."""
        return self.choices[0].message if self.choices else ChatMessage()


class ModelCard(_Open):
    id: str
    object: str = "model"
    owned_by: str | None = None
    # Tandem's extensions: an adapter's base model, "embedding"/"rerank" for non-chat models
    parent: str | None = None
    kind: str | None = None
    max_model_len: int | None = None


class ModelList(_Open):
    data: list[ModelCard] = []


class Embedding(_Open):
    index: int
    embedding: list[float]


class EmbeddingList(_Open):
    """``/v1/embeddings``'s answer (float vectors)."""

    data: list[Embedding] = []

    def vectors(self) -> list[list[float]]:
        """One vector per input, in the inputs' order."""
        return [e.embedding for e in sorted(self.data, key=lambda e: e.index)]


Chunk = TypeVar("Chunk", ChatCompletionChunk, CompletionChunk)


def parse_chunk(data: str, kind: type[Chunk]) -> Chunk:
    """One ``data:`` payload of an OpenAI stream; an error object raises :class:`UpstreamBroken`."""
    try:
        obj: Any = json.loads(data)
        if isinstance(obj, dict) and "error" in obj:
            raise UpstreamBroken(error_message(obj) or str(obj["error"]))
        return kind.model_validate(obj)
    except (ValueError, ValidationError) as exc:
        raise UpstreamBroken(f"malformed stream chunk {data[:200]!r}: {exc}") from None


async def openai_chunks(lines: AsyncIterable[str], kind: type[Chunk]) -> AsyncIterator[Chunk]:
    """The chunks of an OpenAI stream up to ``[DONE]``; without it, :class:`UpstreamBroken`."""
    async for ev in aiter_sse(lines):
        if ev.data == DONE:
            return
        yield parse_chunk(ev.data, kind)
    raise UpstreamBroken("the stream ended before [DONE]", truncated=True)
