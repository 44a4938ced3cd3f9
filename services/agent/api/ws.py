"""Websocket ``/v1/ws/chat``: typed events per contracts.md.

One connection carries many turns, one at a time. A malformed frame, an oversize
frame, an unknown pipeline or collection each get an ``error`` event and the
connection keeps working; ``{"type": "stop"}`` stops the answer being generated
(``done`` with ``finish_reason: "stopped"``); a client that goes away cancels its
running turn, which closes the upstream stream so the inference slot is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import MutableMapping
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from services.agent.api.deps import caller, runtime_of
from services.agent.api.feedback import choose, give_feedback
from services.agent.events import ChoiceEvent, DoneEvent, ErrorEvent, FeedbackAck, WsEvent
from services.agent.protocol import (
    FeedbackCreate,
    WsChatFrame,
    WsChooseFrame,
    WsFeedbackFrame,
    WsRegenerateFrame,
)
from services.agent.runtime import Turn, TurnResult, error_event
from services.common import jsonsafe
from services.common.auth import WS_PROTOCOL
from services.common.errors import TandemError
from services.common.ratelimit import TenantLimiter

router = APIRouter(tags=["websocket"])
log = logging.getLogger("tandem.agent.ws")


class Connection:
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

    async def error(self, message: str, code: str) -> None:
        await self.send(ErrorEvent(message=message, code=code))


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
    runtime = runtime_of(websocket)
    principal, key = caller(websocket)
    conn = Connection(websocket)
    limit = runtime.settings.ws_max_frame_bytes
    current: asyncio.Task[None] | None = None
    current_result: TurnResult | None = None

    limiter: TenantLimiter | None = getattr(websocket.app.state, "limiter", None)
    if limiter is not None and not limiter.enabled:
        limiter = None

    async def admitted() -> bool:
        """Each turn or write counts against the tenant's limits as an HTTP request does (the
        connection's upgrade alone would let one socket send without end)."""
        if limiter is None:
            return True
        refusal = limiter.acquire(principal.tenant)
        if refusal is None:
            return True
        await conn.send(
            ErrorEvent(message=refusal.message, code="rate_limit_exceeded", retry_after=refusal.retry_after)
        )
        return False

    async def run_turn(turn: Turn | str, result: TurnResult) -> None:
        """A chat turn, or (a message id) a regenerated draft of a recorded answer."""
        try:
            events = (
                runtime.regenerate(principal, key, turn, result)
                if isinstance(turn, str)
                else runtime.turn(principal, key, turn, result)
            )
            async for event in events:
                await conn.send(event)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            event = error_event(exc)
            if event.code == "internal_error":
                log.exception("websocket turn failed")
            # No HTTP status on a websocket.
            await conn.send(ErrorEvent(message=event.message, code=event.code))
        finally:
            if limiter is not None:
                limiter.release(principal.tenant)

    try:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
            raw = _frame_text(message)
            if raw is None:
                continue
            if len(raw) > limit:
                await conn.error(
                    f"frame of {len(raw)} bytes is larger than the limit of {limit}", "message_too_large"
                )
                continue
            try:
                # Depth-limited and NaN-free: a deeply nested frame was a RecursionError that
                # ended the handler (and the connection) instead of an error event.
                data = jsonsafe.loads(raw, where="frame")
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                await conn.error(f"frame is not valid JSON: {exc}", "invalid_json")
                continue
            except TandemError as exc:
                await conn.error(exc.message, exc.code or "invalid_frame")
                continue
            if not isinstance(data, dict):
                await conn.error(f"frame must be a JSON object, got {type(data).__name__}", "invalid_frame")
                continue
            kind = data.get("type")
            frames: dict[str, type[WsChatFrame | WsFeedbackFrame | WsRegenerateFrame | WsChooseFrame]] = {
                "feedback": WsFeedbackFrame,
                "regenerate": WsRegenerateFrame,
                "choose": WsChooseFrame,
            }
            model = frames.get(kind, WsChatFrame) if isinstance(kind, str) else WsChatFrame
            try:
                parsed = model.model_validate(data)
            except ValidationError as exc:
                text = "; ".join(
                    f"{'.'.join(str(p) for p in e['loc']) or 'frame'}: {e['msg']}" for e in exc.errors()
                )
                await conn.error(text, "invalid_frame")
                continue
            if isinstance(parsed, WsFeedbackFrame | WsChooseFrame):
                # Quick writes: answered at once, even while an answer is streaming.
                if not await admitted():
                    continue
                try:
                    if isinstance(parsed, WsFeedbackFrame):
                        body = FeedbackCreate.model_validate(parsed.model_dump(exclude={"type"}))
                        await give_feedback(runtime, principal, body)
                        await conn.send(FeedbackAck(message_id=parsed.message_id, ok=True))
                    else:
                        choice = await choose(runtime, principal, parsed.message_id, parsed.over)
                        await conn.send(ChoiceEvent(chosen=choice.chosen, rejected=choice.rejected))
                except TandemError as exc:
                    event = error_event(exc)
                    await conn.send(ErrorEvent(message=event.message, code=event.code, param=exc.param))
                finally:
                    if limiter is not None:
                        limiter.release(principal.tenant)
                continue
            if isinstance(parsed, WsRegenerateFrame):
                if current is not None and not current.done():
                    await conn.error(
                        "a message is still being answered: wait for 'done' or send {'type': 'stop'}", "busy"
                    )
                    continue
                if not await admitted():
                    continue
                current_result = TurnResult()
                current = asyncio.create_task(run_turn(parsed.message_id, current_result))
                continue
            frame = parsed
            if frame.type == "stop":
                if current is not None and not current.done():
                    current.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await current
                    assert current_result is not None
                    await conn.send(
                        DoneEvent(
                            conversation_id=current_result.conversation_id,
                            message_id=current_result.message_id or None,
                            citations=current_result.citations,
                            finish_reason="stopped",
                        )
                    )
                continue
            if current is not None and not current.done():
                await conn.error(
                    "a message is still being answered: wait for 'done' or send {'type': 'stop'}", "busy"
                )
                continue
            target = frame.pipeline or frame.agent
            if not target or (frame.pipeline and frame.agent):
                await conn.error("give exactly one of 'pipeline' or 'agent'", "invalid_frame")
                continue
            if frame.message is None:
                await conn.error("'message' is required", "invalid_frame")
                continue
            turn = Turn(
                target=target,
                message=frame.message,
                collection=frame.collection,
                conversation_id=frame.conversation_id,
                llm=frame.llm,
            )
            if not await admitted():
                continue
            current_result = TurnResult()
            current = asyncio.create_task(run_turn(turn, current_result))
    except WebSocketDisconnect:
        pass
    finally:
        conn.open = False
        if current is not None and not current.done():
            current.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await current
