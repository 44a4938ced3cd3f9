"""Helpers shared by the routers: SSE framing and streamed answers.

(The runtime and the caller are dependencies: services/agent/api/deps.py.)"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from services.agent.events import Event
from services.agent.runtime import guarded


def sse(data: Any) -> bytes:
    """One SSE ``data:`` frame of ``data`` (an event is sent as its wire form)."""
    if isinstance(data, BaseModel):
        data = data.wire() if hasattr(data, "wire") else data.model_dump()
    return f"data: {json.dumps(data, default=str)}\n\n".encode()


def sse_response(frames: AsyncIterator[bytes]) -> StreamingResponse:
    """A stream of SSE frames, unbuffered by proxies on the way."""
    return StreamingResponse(
        frames,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def event_stream(buffered: list[Event], rest: AsyncIterator[Event]) -> StreamingResponse:
    """A turn's events as Server-Sent Events (``peek`` gave ``buffered``; errors end the stream)."""

    async def body() -> AsyncIterator[bytes]:
        async for event in guarded(buffered, rest):
            yield sse(event)

    return sse_response(body())
