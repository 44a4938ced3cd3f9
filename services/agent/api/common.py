"""Helpers shared by the routers: SSE framing, error events, streamed answers.

(The runtime and the caller are dependencies: services/agent/api/deps.py.)"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from services.agent.events import ErrorEvent, Event
from services.common.errors import TandemError


def sse(data: Any) -> bytes:
    """One SSE ``data:`` frame of ``data`` (an event is sent as its wire form)."""
    if isinstance(data, BaseModel):
        data = data.wire() if hasattr(data, "wire") else data.model_dump()
    return f"data: {json.dumps(data, default=str)}\n\n".encode()


def error_event(exc: BaseException) -> ErrorEvent:
    """The ``error`` event of an exception raised during a turn (with the HTTP status it maps to)."""
    if isinstance(exc, TandemError):
        return ErrorEvent(message=exc.message, code=exc.code or exc.type, status=exc.status_code)
    return ErrorEvent(message=f"internal error: {type(exc).__name__}", code="internal_error")


async def guarded(buffered: list[Event], rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """Buffered events, then the rest; an error raised mid-stream becomes a final error event."""
    for event in buffered:
        yield event
    try:
        async for event in rest:
            yield event
    except Exception as exc:
        yield error_event(exc)


def event_stream(buffered: list[Event], rest: AsyncIterator[Event]) -> StreamingResponse:
    """A turn's events as Server-Sent Events (``peek`` gave ``buffered``; errors end the stream)."""

    async def body() -> AsyncIterator[bytes]:
        async for event in guarded(buffered, rest):
            yield sse(event)

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
