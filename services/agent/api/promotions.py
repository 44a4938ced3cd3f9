"""The model a tenant's chat answers with: ``GET /v1/promotions`` (the default, a canary, the
reader, and the gate's verdicts on fine-tunes and readers from feedback),
``POST /v1/models/{id}/promote`` and ``POST /v1/models/{id}/rollback`` (services/agent/promotions.py).
A published reader's id (``ft-reader-...``) promotes or rolls back the tenant's reader instead of
its chat model. Promoting and rolling back change what the whole tenant is served: admin keys only.

``POST /v1/models/{id}/allow`` serves a fine-tune from feedback to everyone in the tenant, whatever
collections its feedback came from (services/agent/model_access.py); ``DELETE`` withdraws that.
Both are an admin's, and recorded in the audit log (``model.allow``, ``model.disallow``)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Body, Query, Request

from services.agent.api.deps import CallerDep, PrincipalDep, RuntimeDep
from services.agent.clients import InferenceClient
from services.agent.model_choice import (
    PromotionStore,
    promoted,
    reader_promoted,
    reader_rolled_back,
    rolled_back,
)
from services.agent.promotions import live_quality
from services.agent.protocol import (
    AllowRequest,
    ModelAllowance,
    ModelChoice,
    PromoteRequest,
    Promotion,
    PromotionList,
    ReaderChoice,
)
from services.agent.upstreams import ServedModels
from services.common.app_factory import RouteResponses
from services.common.audit import actor_of, audit_request
from services.common.auth import Principal, require_admin
from services.common.errors import NotFound
from services.common.readers import is_reader_name

router = APIRouter(tags=["promotions"])

ERRORS: RouteResponses = {
    400: {"description": "canary_share outside 0 to 1, or given for a reader"},
    403: {"description": "a member key (only an admin key changes the tenant's models)"},
    404: {"description": "no such model (or reader) for this tenant"},
    409: {
        "description": "rollback of a model that is neither the default nor the canary (or of a reader not in use)"
    },
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


async def _listed(models: ServedModels, inference: InferenceClient, model: str) -> None:
    """``model`` must be one the inference service lists for the caller (another tenant's is
    not listed: a 404 like a missing one)."""
    try:
        await models.check(inference, model)
    except NotFound:
        raise NotFound(
            f"unknown model {model!r}: use one of the models GET /v1/models on the inference service "
            "lists for this key",
            param="model",
            code="model_not_found",
        ) from None


async def _reader(inference: InferenceClient, name: str) -> ReaderChoice:
    """``name`` as the inference service serves it to the caller (a rerank model), with its
    threshold; not served: a 404 like a missing model."""
    for card in await inference.models():
        if card.id == name and card.kind == "rerank":
            value = (card.model_extra or {}).get("threshold")
            return ReaderChoice(name=name, threshold=float(value) if isinstance(value, int | float) else None)
    raise NotFound(
        f"unknown reader {name!r}: use one of the readers GET /v1/models on the inference service "
        "lists for this key (kind 'rerank')",
        param="model",
        code="model_not_found",
    )


@router.post("/v1/models/{model}/promote", response_model=ModelChoice, responses=ERRORS)
async def promote_model(
    model: str,
    request: Request,
    runtime: RuntimeDep,
    who: CallerDep,
    body: PromoteRequest | None = Body(None),
) -> ModelChoice:
    """Makes ``model`` the tenant's default for chat (or, with ``canary_share``, has it answer
    that share of the tenant's chats); a reader (``ft-reader-...``) becomes the tenant's reader."""
    principal, key = who
    require_admin(principal, "POST /v1/models/{model}/promote")
    share = body.canary_share if body else None
    current = await runtime.promotions.choice(principal.tenant)
    if is_reader_name(model):
        reader_promoted(current, ReaderChoice(name=model), share, time.time())  # a share: 400 first
        choice = reader_promoted(
            current, await _reader(runtime.upstreams.inference(key), model), share, time.time()
        )
        await runtime.promotions.save_choice(principal.tenant, choice)
        await audit_request(request, "model.promote", model, {"reader": True})
        return choice
    choice = promoted(current, model, share, time.time())  # a bad share is a 400 before any lookup
    await _listed(runtime.models, runtime.upstreams.inference(key), model)
    await runtime.promotions.save_choice(principal.tenant, choice)
    await audit_request(request, "model.promote", model, {"canary_share": share})
    return choice


@router.post("/v1/models/{model}/rollback", response_model=ModelChoice, responses=ERRORS)
async def rollback_model(model: str, request: Request, runtime: RuntimeDep, who: CallerDep) -> ModelChoice:
    """Stops ``model`` answering the tenant's chats: a canary ends; a default gives way to the one
    before it (the base model at the start); a reader gives way to the one before it (the agent's
    reader setting at the start)."""
    principal, key = who
    require_admin(principal, "POST /v1/models/{model}/rollback")
    current = await runtime.promotions.choice(principal.tenant)
    if is_reader_name(model):
        if current.reader is None or current.reader.name != model:
            await _reader(
                runtime.upstreams.inference(key), model
            )  # unknown: 404; known but not in use: 409 below
        choice = reader_rolled_back(current, model, time.time())
        await runtime.promotions.save_choice(principal.tenant, choice)
        await audit_request(request, "model.rollback", model, {"reader": True})
        return choice
    if model not in (current.default, current.canary):
        await _listed(
            runtime.models, runtime.upstreams.inference(key), model
        )  # unknown: 404; known but not in use: 409 below
    choice = rolled_back(current, model, time.time())
    await runtime.promotions.save_choice(principal.tenant, choice)
    await audit_request(request, "model.rollback", model, {"default": choice.default})
    return choice


ALLOW_ERRORS: RouteResponses = {
    403: {"description": "not an admin of the tenant"},
    404: {"description": "no fine-tune of that name from this tenant's feedback"},
}


async def _trained(store: PromotionStore, principal: Principal, model: str) -> Promotion:
    found = await store.trained_as(principal.tenant, model)
    if found is None:
        raise NotFound(
            f"model: {model!r} is no fine-tune from this tenant's feedback (GET /v1/promotions lists "
            "them); other models are served to everyone who may use them already",
            param="model",
            code="model_not_found",
        )
    return found


@router.post("/v1/models/{model}/allow", response_model=Promotion, responses=ALLOW_ERRORS)
async def allow_model(
    model: str,
    request: Request,
    runtime: RuntimeDep,
    principal: PrincipalDep,
    body: AllowRequest | None = Body(None),
) -> Promotion:
    """Serves the fine-tune ``model`` to everyone in the tenant, including people who may not read
    every collection its feedback came from (``collections``)."""
    require_admin(principal, "POST /v1/models/{model}/allow")
    found = await _trained(runtime.promotions, principal, model)
    reason = body.reason if body else ""
    found.allowed = ModelAllowance(by=actor_of(principal).id, at=time.time(), reason=reason)
    await runtime.promotions.save(principal.tenant, found)
    await audit_request(request, "model.allow", model, {"collections": found.collections, "reason": reason})
    return found


@router.delete("/v1/models/{model}/allow", response_model=Promotion, responses=ALLOW_ERRORS)
async def disallow_model(
    model: str, request: Request, runtime: RuntimeDep, principal: PrincipalDep
) -> Promotion:
    """Withdraws ``allow``: the fine-tune answers only people who may read all of its collections."""
    require_admin(principal, "DELETE /v1/models/{model}/allow")
    found = await _trained(runtime.promotions, principal, model)
    was = found.allowed
    found.allowed = None
    await runtime.promotions.save(principal.tenant, found)
    await audit_request(
        request, "model.disallow", model, {"collections": found.collections, "was_allowed": was is not None}
    )
    return found
