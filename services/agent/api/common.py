"""Helpers shared by the routers: the caller's key and principal, SSE framing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import HTTPConnection

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
    return f"data: {json.dumps(data, default=str)}\n\n".encode()


def error_event(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, TandemError):
        return {
            "type": "error",
            "message": exc.message,
            "code": exc.code or exc.type,
            "status": exc.status_code,
        }
    return {"type": "error", "message": f"internal error: {type(exc).__name__}", "code": "internal_error"}


async def guarded(
    buffered: list[dict[str, Any]], rest: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    """Buffered events, then the rest; an error raised mid-stream becomes a final error event."""
    for event in buffered:
        yield event
    try:
        async for event in rest:
            yield event
    except Exception as exc:
        yield error_event(exc)
