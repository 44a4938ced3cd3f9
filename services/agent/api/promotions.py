"""The model a tenant's chat answers with: ``GET /v1/promotions`` (the default, a canary, and the
gate's verdicts on fine-tunes from feedback), ``POST /v1/models/{id}/promote`` and
``POST /v1/models/{id}/rollback`` (services/agent/promotions.py)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Body, Query

from services.agent.api.deps import CallerDep, PrincipalDep, RuntimeDep
from services.agent.promotions import live_quality, promoted, rolled_back
from services.agent.protocol import ModelChoice, PromoteRequest, PromotionList
from services.agent.runtime import AgentRuntime
from services.common.auth import Principal
from services.common.errors import NotFound

router = APIRouter(tags=["promotions"])

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "canary_share outside 0 to 1"},
    404: {"description": "no such model for this tenant"},
    409: {"description": "rollback of a model that is neither the default nor the canary"},
}


@router.get("/v1/promotions", response_model=PromotionList)
async def list_promotions(
    runtime: RuntimeDep, principal: PrincipalDep, limit: int = Query(20, ge=1, le=200)
) -> PromotionList:
    choice = await runtime.promotions.choice(principal.tenant)
    return PromotionList(
        choice=choice,
        live=await live_quality(runtime.turns, principal.tenant, choice),
        data=await runtime.promotions.recent(principal.tenant, limit),
    )


async def _listed(runtime: AgentRuntime, principal: Principal, key: str, model: str) -> None:
    """``model`` must be one the inference service lists for the caller (another tenant's is
    not listed: a 404 like a missing one)."""
    try:
        await runtime.check_llm(runtime.inference(key), model)
    except NotFound:
        raise NotFound(
            f"unknown model {model!r}: use one of the models GET /v1/models on the inference service "
            "lists for this key",
            param="model",
            code="model_not_found",
        ) from None


@router.post("/v1/models/{model}/promote", response_model=ModelChoice, responses=ERRORS)
async def promote_model(
    model: str, runtime: RuntimeDep, who: CallerDep, body: PromoteRequest | None = Body(None)
) -> ModelChoice:
    """Makes ``model`` the tenant's default for chat (or, with ``canary_share``, has it answer
    that share of the tenant's chats)."""
    principal, key = who
    share = body.canary_share if body else None
    current = await runtime.promotions.choice(principal.tenant)
    choice = promoted(current, model, share, time.time())  # a bad share is a 400 before any lookup
    await _listed(runtime, principal, key, model)
    await runtime.promotions.save_choice(principal.tenant, choice)
    return choice


@router.post("/v1/models/{model}/rollback", response_model=ModelChoice, responses=ERRORS)
async def rollback_model(model: str, runtime: RuntimeDep, who: CallerDep) -> ModelChoice:
    """Stops ``model`` answering the tenant's chats: a canary ends; a default gives way to the one
    before it (the base model at the start)."""
    principal, key = who
    current = await runtime.promotions.choice(principal.tenant)
    if model not in (current.default, current.canary):
        await _listed(runtime, principal, key, model)  # unknown: 404; known but not in use: 409 below
    choice = rolled_back(current, model, time.time())
    await runtime.promotions.save_choice(principal.tenant, choice)
    return choice
