"""Held tool calls of agents (``side_effects: approve``): ``GET /v1/agents/approvals`` lists the
caller's pending ones; ``POST /v1/agents/approvals/{id}`` decides one and answers with the turn
run again (JSON, or SSE with ``stream: true``, as ``POST /v1/pipelines/{name}/run`` answers)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from services.agent.api.common import event_stream
from services.agent.api.deps import CallerDep, PrincipalDep, RuntimeDep
from services.agent.approvals import ApprovalList
from services.agent.events import ErrorEvent
from services.agent.protocol import ApprovalDecision
from services.agent.runtime import TurnResult, collect, peek
from services.common.app_factory import JSON_OR_SSE

router = APIRouter(
    tags=["agents"],
    responses={
        404: {"description": "no such approval for this key"},
        409: {"description": "the approval was already decided"},
        410: {"description": "the approval expired"},
    },
)


@router.get("/v1/agents/approvals")
async def list_approvals(runtime: RuntimeDep, principal: PrincipalDep) -> ApprovalList:
    pending = await runtime.approvals.pending(principal.tenant, principal.owner)
    return ApprovalList(data=[a.public() for a in pending])


@router.post("/v1/agents/approvals/{approval_id}", response_model=None, responses=JSON_OR_SSE)
async def decide_approval(
    approval_id: str, body: ApprovalDecision, runtime: RuntimeDep, who: CallerDep
) -> Any:
    principal, key = who
    held = await runtime.approvals.get(principal.tenant, principal.owner, approval_id)
    result = TurnResult()
    events = runtime.resume(principal, key, approval_id, body.approve, result)
    if not body.stream:
        collected = await collect(events)
        errors = [e for e in collected if isinstance(e, ErrorEvent)]
        out = result.pipeline_answer(held.agent, held.message, errors[-1] if errors else None)
        out["approval_id"] = approval_id
        out["decision"] = "approved" if body.approve else "denied"
        return out
    return event_stream(*await peek(events))
