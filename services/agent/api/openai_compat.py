"""OpenAI-compatible facade: ``model`` names a pipeline or agent, ``collection`` is an extra field.

Any OpenAI client can chat with documents. Citations ride in a top-level
``citations`` list of the response, and of the last chunk of a stream.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from services.agent.api.common import error_event, sse
from services.agent.api.deps import CallerDep, RuntimeDep
from services.agent.events import ErrorEvent, Event, ResetEvent, TokenEvent
from services.agent.protocol import ChatCompletionRequest
from services.agent.runtime import Turn, TurnResult, collect, peek
from services.common.app_factory import JSON_OR_SSE
from services.common.errors import InvalidRequest, TandemError

router = APIRouter(tags=["openai"], responses={404: {"description": "no such model or collection"}})


@router.get("/v1/models")
async def models(runtime: RuntimeDep) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": item["id"], "object": "model", "created": 0, "owned_by": "tandem", "kind": item["kind"]}
            for item in runtime.catalog()
        ],
    }


def _render_results(results: list[dict[str, Any]]) -> str:
    lines = []
    for i, r in enumerate(results, 1):
        passage = (r.get("passage") or {}).get("text") or r.get("text", "")
        lines.append(f"[{i}] {r.get('title') or r.get('document_id')}: {passage}")
    return "\n".join(lines) or "No results."


def _citations(result: TurnResult) -> list[dict[str, Any]]:
    if result.citations or result.results is None:
        return result.citations
    return [
        {
            "index": i,
            "chunk_id": r["chunk_id"],
            "document_id": r["document_id"],
            "title": r.get("title", ""),
            "text": r["text"],
            "start": r["start"],
            "end": r["end"],
        }
        for i, r in enumerate(result.results, 1)
    ]


@router.post("/v1/chat/completions", response_model=None, responses=JSON_OR_SSE)
async def chat_completions(body: ChatCompletionRequest, runtime: RuntimeDep, who: CallerDep) -> Any:
    principal, key = who
    if body.messages[-1].role != "user":
        raise InvalidRequest("the last message must come from the user", param="messages")
    history = [
        {"role": m.role, "content": m.text()} for m in body.messages[:-1] if m.role in ("user", "assistant")
    ]
    turn = Turn(
        target=body.model,
        message=body.messages[-1].text(),
        collection=body.collection,
        conversation_id=body.conversation_id,
        history=history,
        remember=body.conversation_id is not None,
        llm=body.llm,
    )
    try:
        runtime.validate(turn)
    except TandemError as exc:
        if exc.param == "pipeline":
            exc.param = "model"
        raise
    result = TurnResult()
    events = runtime.turn(principal, key, turn, result)
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    if not body.stream:
        await collect(events)
        content = result.answer if result.results is None else _render_results(result.results)
        return {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": body.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop" if result.error is None else "length",
                }
            ],
            "usage": {
                "prompt_tokens": result.usage.get("prompt_tokens", 0),
                "completion_tokens": result.usage.get("completion_tokens", 0),
                "total_tokens": result.usage.get("total_tokens", 0),
            },
            "citations": _citations(result),
            "message_id": result.message_id,
            "conversation_id": result.conversation_id,
        }
    buffered, rest = await peek(events)

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        return sse(
            {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                **extra,
            }
        )

    async def stream() -> AsyncIterator[bytes]:
        yield chunk({"role": "assistant", "content": ""})

        async def all_events() -> AsyncIterator[Event]:
            for event in buffered:
                yield event
            async for event in rest:
                yield event

        try:
            async for event in all_events():
                if isinstance(event, TokenEvent):
                    yield chunk({"content": event.text})
                elif isinstance(event, ResetEvent):
                    # An OpenAI stream cannot take text back: the guard's answer follows on its own
                    # paragraph, and the last chunk says kind "extractive".
                    yield chunk({"content": "\n\n"})
                elif isinstance(event, ErrorEvent):
                    yield sse({"error": {"message": event.message, "code": event.code}})
        except Exception as exc:
            err = error_event(exc)
            yield sse({"error": {"message": err.message, "code": err.code}})
        if result.results is not None:
            yield chunk({"content": _render_results(result.results)})
        extra: dict[str, Any] = {
            "citations": _citations(result),
            "message_id": result.message_id or None,
            "conversation_id": result.conversation_id,
        }
        if result.grounding is not None:
            extra["kind"] = result.answer_kind
        if result.usage and (body.stream_options or {}).get("include_usage"):
            extra["usage"] = result.usage
        yield chunk({}, "stop", **extra)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
