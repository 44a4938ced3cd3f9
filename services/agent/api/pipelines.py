"""POST /v1/pipelines/{name}/run (JSON, or SSE with ``stream: true``) and GET /v1/pipelines."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from services.agent.api.common import caller, guarded, runtime_of, sse
from services.agent.protocol import PipelineRunRequest
from services.agent.runtime import Turn, TurnResult, collect, peek
from services.common.app_factory import JSON_OR_SSE

router = APIRouter(tags=["pipelines"], responses={404: {"description": "no such pipeline, or collection"}})


@router.get("/v1/pipelines")
async def list_pipelines(request: Request) -> dict[str, Any]:
    return {"data": runtime_of(request).catalog()}


@router.post("/v1/pipelines/{name}/run", response_model=None, responses=JSON_OR_SSE)
async def run_pipeline(name: str, body: PipelineRunRequest, request: Request) -> Any:
    runtime = runtime_of(request)
    principal, key = caller(request)
    turn = Turn(
        target=name,
        message=body.question(),
        collection=body.collection,
        conversation_id=body.conversation_id,
        history=[{"role": m.role, "content": m.text()} for m in body.history or []],
        remember=body.remember or body.conversation_id is not None,
        options={"top_k": body.top_k} if body.top_k else {},
        llm=body.llm,
    )
    result = TurnResult()
    events = runtime.turn(principal, key, turn, result)
    if not body.stream:
        collected = await collect(events)
        out: dict[str, Any] = {"pipeline": name, "query": turn.message, "message_id": result.message_id}
        if result.model:
            out["model"] = result.model
        if result.conversation_id:
            out["conversation_id"] = result.conversation_id
        if result.results is not None:
            out["results"] = result.results
        else:
            out.update(
                answer=result.answer,
                citations=result.citations,
                invalid_citations=result.invalid_citations,
                usage=result.usage,
                finish_reason=result.finish_reason,
            )
            if result.grounding is not None:
                out.update(
                    kind=result.answer_kind, grounding=result.grounding, unsupported=result.unsupported
                )
        if result.steps:
            out["steps"] = result.steps
        errors = [e for e in collected if e["type"] == "error"]
        if errors:
            out["error"] = {"message": errors[-1]["message"], "code": errors[-1].get("code")}
        return out
    buffered, rest = await peek(events)

    async def body_iter() -> AsyncIterator[bytes]:
        async for event in guarded(buffered, rest):
            yield sse(event)

    return StreamingResponse(
        body_iter(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
