"""POST /v1/pipelines/{name}/run (JSON, or SSE with ``stream: true``) and GET /v1/pipelines."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from services.agent.api.common import event_stream
from services.agent.api.deps import CallerDep, RuntimeDep
from services.agent.events import ErrorEvent
from services.agent.protocol import PipelineRunRequest
from services.agent.runtime import Turn, TurnResult, collect, peek
from services.common.app_factory import JSON_OR_SSE

router = APIRouter(tags=["pipelines"], responses={404: {"description": "no such pipeline, or collection"}})


class Catalog(BaseModel):
    """The pipelines and agents a message may name: ``id``, ``kind`` and ``description`` each."""

    data: list[dict[str, str]]


@router.get("/v1/pipelines")
async def list_pipelines(runtime: RuntimeDep) -> Catalog:
    return Catalog(data=runtime.catalog())


@router.post("/v1/pipelines/{name}/run", response_model=None, responses=JSON_OR_SSE)
async def run_pipeline(name: str, body: PipelineRunRequest, runtime: RuntimeDep, who: CallerDep) -> Any:
    principal, key = who
    turn = Turn.of_run(name, body)
    result = TurnResult()
    events = runtime.turn(principal, key, turn, result)
    if not body.stream:
        collected = await collect(events)
        errors = [e for e in collected if isinstance(e, ErrorEvent)]
        return result.pipeline_answer(name, turn.message, errors[-1] if errors else None)
    return event_stream(*await peek(events))
