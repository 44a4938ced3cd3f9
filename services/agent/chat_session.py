"""One websocket chat connection's turns, frame by frame (services/agent/api/ws.py is its route).

One connection carries many turns, one at a time. A malformed frame, an oversize frame, an unknown
pipeline or collection each get an ``error`` event and the connection keeps working;
``{"type": "stop"}`` stops the answer being generated (``done`` with ``finish_reason: "stopped"``);
feedback and choose frames are answered at once, even while an answer streams; closing cancels
the running turn, which closes the upstream stream so the inference slot is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable

from pydantic import ValidationError

from services.agent.events import ChoiceEvent, DoneEvent, ErrorEvent, FeedbackAck, WsEvent
from services.agent.protocol import (
    FeedbackCreate,
    WsChatFrame,
    WsChooseFrame,
    WsFeedbackFrame,
    WsRegenerateFrame,
)
from services.agent.runtime import AgentRuntime, Turn, TurnResult, error_event
from services.common import jsonsafe
from services.common.auth import Principal
from services.common.errors import TandemError
from services.common.ratelimit import TenantLimiter

log = logging.getLogger("tandem.agent.ws")

Frame = WsChatFrame | WsFeedbackFrame | WsRegenerateFrame | WsChooseFrame
# a frame's "type" picks its model; chat (and stop) is the default
_FRAMES: dict[str, type[Frame]] = {
    "feedback": WsFeedbackFrame,
    "regenerate": WsRegenerateFrame,
    "choose": WsChooseFrame,
}
_BUSY = "a message is still being answered: wait for 'done' or send {'type': 'stop'}"


class ChatSession:
    """The turns of one connection: ``receive`` each frame's text, ``close`` at the end."""

    def __init__(
        self,
        runtime: AgentRuntime,
        principal: Principal,
        key: str,
        send: Callable[[WsEvent], Awaitable[None]],
        limiter: TenantLimiter | None,
    ) -> None:
        self.runtime, self.principal, self.key, self.send = runtime, principal, key, send
        self.limiter = limiter if limiter is not None and limiter.enabled else None
        self.current: asyncio.Task[None] | None = None
        self.current_result: TurnResult | None = None

    async def error(self, message: str, code: str) -> None:
        await self.send(ErrorEvent(message=message, code=code))

    def busy(self) -> bool:
        return self.current is not None and not self.current.done()

    async def admitted(self) -> bool:
        """Each turn or write counts against the tenant's limits as an HTTP request does (the
        connection's upgrade alone would let one socket send without end)."""
        if self.limiter is None:
            return True
        refusal = self.limiter.acquire(self.principal.tenant)
        if refusal is None:
            return True
        await self.send(
            ErrorEvent(message=refusal.message, code="rate_limit_exceeded", retry_after=refusal.retry_after)
        )
        return False

    def release(self) -> None:
        if self.limiter is not None:
            self.limiter.release(self.principal.tenant)

    async def _parse(self, raw: str | bytes) -> Frame | None:
        """The frame ``raw`` is, or None after an error event saying what is wrong with it."""
        limit = self.runtime.settings.ws_max_frame_bytes
        if len(raw) > limit:
            await self.error(
                f"frame of {len(raw)} bytes is larger than the limit of {limit}", "message_too_large"
            )
            return None
        try:
            # Depth-limited and NaN-free: a deeply nested frame was a RecursionError that
            # ended the handler (and the connection) instead of an error event.
            data = jsonsafe.loads(raw, where="frame")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            await self.error(f"frame is not valid JSON: {exc}", "invalid_json")
            return None
        except TandemError as exc:
            await self.error(exc.message, exc.code or "invalid_frame")
            return None
        if not isinstance(data, dict):
            await self.error(f"frame must be a JSON object, got {type(data).__name__}", "invalid_frame")
            return None
        kind = data.get("type")
        model = _FRAMES.get(kind, WsChatFrame) if isinstance(kind, str) else WsChatFrame
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            text = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'frame'}: {e['msg']}" for e in exc.errors()
            )
            await self.error(text, "invalid_frame")
            return None

    async def receive(self, raw: str | bytes) -> None:
        """One frame: answered, or a turn started (or stopped)."""
        frame = await self._parse(raw)
        if frame is None:
            return
        if isinstance(frame, WsFeedbackFrame | WsChooseFrame):
            await self._write(frame)
        elif isinstance(frame, WsRegenerateFrame):
            await self._start(frame.message_id)
        elif frame.type == "stop":
            await self._stop()
        else:
            await self._chat(frame)

    async def _write(self, frame: WsFeedbackFrame | WsChooseFrame) -> None:
        # Quick writes: answered at once, even while an answer is streaming.
        if not await self.admitted():
            return
        try:
            if isinstance(frame, WsFeedbackFrame):
                body = FeedbackCreate.model_validate(frame.model_dump(exclude={"type"}))
                await self.runtime.feedback.give(self.principal, body)
                await self.send(FeedbackAck(message_id=frame.message_id, ok=True))
            else:
                choice = await self.runtime.feedback.choose(self.principal, frame.message_id, frame.over)
                await self.send(ChoiceEvent(chosen=choice.chosen, rejected=choice.rejected))
        except TandemError as exc:
            event = error_event(exc)
            await self.send(ErrorEvent(message=event.message, code=event.code, param=exc.param))
        finally:
            self.release()

    async def _chat(self, frame: WsChatFrame) -> None:
        if self.busy():
            await self.error(_BUSY, "busy")
            return
        target = frame.pipeline or frame.agent
        if not target or (frame.pipeline and frame.agent):
            await self.error("give exactly one of 'pipeline' or 'agent'", "invalid_frame")
            return
        if frame.message is None:
            await self.error("'message' is required", "invalid_frame")
            return
        turn = Turn(
            target=target,
            message=frame.message,
            collection=frame.collection,
            conversation_id=frame.conversation_id,
            llm=frame.llm,
        )
        await self._start(turn, check_busy=False)

    async def _start(self, turn: Turn | str, check_busy: bool = True) -> None:
        """Starts a chat turn, or (a message id) a regenerated draft of a recorded answer."""
        if check_busy and self.busy():
            await self.error(_BUSY, "busy")
            return
        if not await self.admitted():
            return
        self.current_result = TurnResult()
        self.current = asyncio.create_task(self._run(turn, self.current_result))

    async def _run(self, turn: Turn | str, result: TurnResult) -> None:
        try:
            events = (
                self.runtime.regenerate(self.principal, self.key, turn, result)
                if isinstance(turn, str)
                else self.runtime.turn(self.principal, self.key, turn, result)
            )
            async for event in events:
                await self.send(event)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            event = error_event(exc)
            if event.code == "internal_error":
                log.exception("websocket turn failed")
            # No HTTP status on a websocket.
            await self.send(ErrorEvent(message=event.message, code=event.code))
        finally:
            self.release()

    async def _cancel(self) -> bool:
        """Cancels the running turn; whether there was one."""
        if self.current is None or self.current.done():
            return False
        self.current.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.current
        return True

    async def _stop(self) -> None:
        if await self._cancel():
            result = self.current_result
            assert result is not None
            await self.send(
                DoneEvent(
                    conversation_id=result.conversation_id,
                    message_id=result.message_id or None,
                    citations=result.citations,
                    finish_reason="stopped",
                )
            )

    async def close(self) -> None:
        """The connection is gone: its running turn (and the upstream stream) is cancelled."""
        await self._cancel()
