"""OpenAI-compatible facade: ``model`` names a pipeline or agent, ``collection`` is an extra field.

Any OpenAI client can chat with documents. Citations ride in a top-level
``citations`` list of the response, and of the last chunk of a stream.

``tools``, ``tool_choice``, ``parallel_tool_calls`` and ``response_format`` go to the chat
pipeline's generation step as sent (the inference service validates and enforces them), with the
retrieved sources still in the prompt; assistant tool calls and tool results in ``messages`` are
kept in the history, and those after the last user message follow the prompt the pipeline builds.
The model's calls come back in OpenAI's shape (``message.tool_calls``, ``delta.tool_calls``,
``finish_reason: "tool_calls"``). Agents run their own tools and refuse the caller's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse

from services.agent.api.common import error_event, sse
from services.agent.api.deps import CallerDep, RuntimeDep
from services.agent.events import ErrorEvent, Event, ResetEvent, TokenEvent, ToolCallDeltaEvent
from services.agent.pipelines.state import AnswerForm
from services.agent.protocol import ChatCompletionRequest, Message
from services.agent.runtime import Turn, TurnResult, collect, peek
from services.common.app_factory import JSON_OR_SSE
from services.common.errors import InvalidRequest, TandemError, error_body

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


def _wire(m: Message) -> dict[str, Any]:
    """A history message as the prompt takes it: text content, and the tool fields it has."""
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None and m.role == "tool":
        out["name"] = m.name
    return out


def _split(messages: list[Message]) -> tuple[list[dict[str, Any]], Message, list[dict[str, Any]]]:
    """The history, the question (the last user message) and what follows it: the assistant's
    tool calls and their results, which the model continues from. A tool result must answer a
    call made before it (a 400 naming the message otherwise, as OpenAI does)."""
    asked = [i for i, m in enumerate(messages) if m.role == "user"]
    if not asked:
        raise InvalidRequest("messages need a user message", param="messages")
    last = asked[-1]
    after = messages[last + 1 :]
    if after and (after[-1].role != "tool" or any(m.role not in ("assistant", "tool") for m in after)):
        raise InvalidRequest(
            "the last message must come from the user, or be a tool result after the last user message",
            param="messages",
        )
    calls: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "assistant":
            calls.update(c.id for c in m.tool_calls or [])
        elif m.role == "tool":
            if not m.tool_call_id:
                raise InvalidRequest(
                    f"messages[{i}]: a tool message needs tool_call_id", param=f"messages[{i}].tool_call_id"
                )
            if m.tool_call_id not in calls:
                raise InvalidRequest(
                    f"messages[{i}]: tool_call_id {m.tool_call_id!r} answers no tool call of an earlier "
                    "assistant message",
                    param=f"messages[{i}].tool_call_id",
                )
    # The pipeline writes its own instructions: the caller's system (developer) messages are not sent.
    history = [_wire(m) for m in messages[:last] if m.role in ("user", "assistant", "tool")]
    return history, messages[last], [_wire(m) for m in after]


def _form(body: ChatCompletionRequest, tail: list[dict[str, Any]]) -> AnswerForm | None:
    form = AnswerForm(
        tools=body.tools,
        tool_choice=body.tool_choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=body.response_format,
        tail=tail,
    )
    return form if form.body() or tail else None


def _usage(result: TurnResult) -> dict[str, int]:
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    return {k: result.usage.get(k, 0) for k in keys}


def _finish_reason(result: TurnResult) -> str:
    if result.tool_calls:
        return "tool_calls"
    if result.error is not None or result.finish_reason == "length":
        return "length"
    return "stop"


# HTTP status of a turn that ended in an error event rather than an exception (whose status the
# event carries): the agent's budgets. A 5xx, as OpenAI answers a generation it could not finish;
# the `openai` client retries those (max_retries), which may help where sampling is on.
_FAILED_TURN_STATUS = {"time_budget_exceeded": 504, "step_budget_exceeded": 500}


def _failed_turn(error: ErrorEvent) -> JSONResponse:
    """A turn that failed is an error in OpenAI's shape, never a 200 with a cut answer."""
    status = error.status or _FAILED_TURN_STATUS.get(error.code or "", 500)
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(type_, error.message, error.param, error.code), status_code=status)


def _tool_calls(result: TurnResult) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": c.function.model_dump()} for c in result.tool_calls]


def _tool_call_delta(event: ToolCallDeltaEvent) -> dict[str, Any]:
    """OpenAI's ``delta.tool_calls`` entry: index, then id/type/name on a call's first piece, and
    argument text (only what the inference's own delta had)."""
    out: dict[str, Any] = {"index": event.index}
    if event.id is not None:
        out.update(id=event.id, type="function")
    function: dict[str, str] = {}
    if event.name is not None:
        function["name"] = event.name
    if event.arguments is not None:
        function["arguments"] = event.arguments
    if function:
        out["function"] = function
    return out


@router.post("/v1/chat/completions", response_model=None, responses=JSON_OR_SSE)
async def chat_completions(body: ChatCompletionRequest, runtime: RuntimeDep, who: CallerDep) -> Any:
    principal, key = who
    if body.stream_options is not None and not body.stream:
        # as OpenAI, vLLM and the inference service answer
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    history, question, tail = _split(body.messages)
    options: dict[str, Any] = {}
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    turn = Turn(
        target=body.model,
        message=question.text(),
        collection=body.collection,
        conversation_id=body.conversation_id,
        history=history,
        remember=body.conversation_id is not None,
        options=options,
        llm=body.llm,
        form=_form(body, tail),
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
        if result.error is not None:
            return _failed_turn(result.error)
        content: str | None = result.answer if result.results is None else _render_results(result.results)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if result.tool_calls:
            message.update(content=result.answer or None, tool_calls=_tool_calls(result))
        return {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": body.model,
            "choices": [{"index": 0, "message": message, "finish_reason": _finish_reason(result)}],
            "usage": _usage(result),
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
                elif isinstance(event, ToolCallDeltaEvent):
                    yield chunk({"tool_calls": [_tool_call_delta(event)]})
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
        if (body.stream_options or {}).get("include_usage"):
            # asked for, it is always there (zeros when no model was called, as for a search)
            extra["usage"] = _usage(result)
        yield chunk({}, _finish_reason(result), **extra)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
