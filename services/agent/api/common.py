"""Helpers shared by the routers: the caller's key and principal, SSE framing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel
from starlette.requests import HTTPConnection

from services.agent.events import ErrorEvent, Event
from services.agent.runtime import AgentRuntime
from services.common.auth import Principal, bearer_token
from services.common.errors import TandemError, Unauthorized


def runtime_of(conn: HTTPConnection) -> AgentRuntime:
    runtime: AgentRuntime = conn.app.state.runtime
    return runtime


def caller(conn: HTTPConnection) -> tuple[Principal, str]:
    """The authenticated principal and the key itself (passed on to retrieval and inference)."""
    principal = getattr(conn.state, "principal", None)
    key = bearer_token(conn)
    if not isinstance(principal, Principal) or not key:
        raise Unauthorized("not authenticated")
    return principal, key


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
