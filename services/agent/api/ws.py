"""Websocket ``/v1/ws/chat``: typed events per contracts.md.

The route accepts the connection and hands each frame to its ChatSession
(services/agent/chat_session.py), which runs the turns.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from services.agent.api.deps import caller, runtime_of
from services.agent.chat_session import ChatSession
from services.agent.events import WsEvent
from services.common.auth import WS_PROTOCOL
from services.common.ratelimit import TenantLimiter

router = APIRouter(tags=["websocket"])


class Connection:
    """The socket's sending side: one event at a time; a closed socket drops them."""

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws
        self.lock = asyncio.Lock()
        self.open = True

    async def send(self, event: WsEvent) -> None:
        if not self.open:
            return
        async with self.lock:
            try:
                await self.ws.send_text(json.dumps(event.wire(), default=str))
            except (WebSocketDisconnect, RuntimeError, OSError):
                self.open = False


def _frame_text(message: MutableMapping[str, Any]) -> str | bytes | None:
    if message.get("text") is not None:
        return str(message["text"])
    if message.get("bytes") is not None:
        return bytes(message["bytes"])
    return None


@router.websocket("/v1/ws/chat")
async def ws_chat(websocket: WebSocket) -> None:
    offered = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",")]
    await websocket.accept(subprotocol=WS_PROTOCOL if WS_PROTOCOL in offered else None)
    conn = Connection(websocket)
    limiter: TenantLimiter | None = getattr(websocket.app.state, "limiter", None)
    session = ChatSession(runtime_of(websocket), *caller(websocket), conn.send, limiter)
    try:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
            raw = _frame_text(message)
            if raw is not None:
                await session.receive(raw)
    except WebSocketDisconnect:
        pass
    finally:
        conn.open = False
        await session.close()
