"""The one reader of server-sent events and of OpenAI's stream chunks, for every client in the stack.

:func:`iter_sse` / :func:`aiter_sse` turn the lines of a ``text/event-stream`` body into events
(``event:`` and ``data:`` fields, an event ending at a blank line, ``:`` comments skipped, as the
WHATWG spec has it). :func:`openai_chunks` reads OpenAI's chat or text completion stream into
the chunk models of services/common/openai_wire.py: ``data: [DONE]`` ends it, an
``{"error": ...}`` object or a malformed chunk raises :class:`UpstreamBroken`, and so does a
stream that ends without ``[DONE]`` (the server died or the connection dropped: such an answer
is cut short, not complete).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import ValidationError

from services.common.openai_wire import ChatCompletionChunk, TextCompletion
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


Chunk = TypeVar("Chunk", ChatCompletionChunk, TextCompletion)


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
