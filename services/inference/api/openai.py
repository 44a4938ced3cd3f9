"""OpenAI-compatible routes plus vLLM's adapter routes and Tandem's model registration (thin).

Roles: loading adapters and registering models (for any tenant, or shared) needs an
operator key; unloading, unregistering and ``DELETE /v1/models/{name}`` take an operator
key or the owning tenant's. Everything else takes any key, and sees shared models plus
the caller's own.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common.app_factory import JSON_OR_SSE
from services.common.auth import principal_of, require_operator
from services.common.errors import Conflict, InvalidRequest, NotFound
from services.common.paths import resolve_under_roots
from services.inference.engine.types import EngineError
from services.inference.protocol import (
    Capabilities,
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraRequest,
    ModelCard,
    ModelList,
    RegisterModelRequest,
    UnloadLoraRequest,
    UnregisterModelRequest,
)
from services.inference.registry import ModelRegistry
from services.inference.serving import OpenAIServing, http_error

router = APIRouter(
    tags=["openai"],
    responses={
        403: {"description": "an operator route called without an operator key, or another tenant's model"},
        404: {"description": "no such model or adapter"},
        409: {"description": "a model or adapter of that name is already served"},
        503: {"description": "the model is still loading, or could not be loaded"},
    },
)
_STARTED = int(time.time())


def _registry(request: Request) -> ModelRegistry:
    registry: ModelRegistry | None = getattr(request.app.state, "registry", None)
    if registry is None:
        from services.common.errors import ServiceUnavailable

        raise ServiceUnavailable("the model is still loading")
    return registry


def _server_path(request: Request, value: str, param: str) -> Path:
    path = resolve_under_roots(value, request.app.state.common.allowed_model_roots, param=param)
    if not path.exists():
        raise InvalidRequest(f"{param}: {value!r} does not exist", param=param)
    return path


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    """The served base models, shared fine-tunes, and the caller tenant's own."""
    try:
        served = await _registry(request).models(principal_of(request))
    except EngineError as exc:
        raise http_error(exc) from None
    return ModelList(
        data=[
            ModelCard(
                id=m.id,
                created=_STARTED,
                owned_by=m.owned_by,
                root=m.parent if m.kind == "registered" else (m.id if m.kind == "base" else None),
                parent=m.parent if m.kind == "adapter" else None,
                max_model_len=m.max_model_len,
                kind=m.kind if m.kind in ("adapter", "registered") else "base",  # type: ignore[arg-type]
            )
            for m in served
        ]
        # Embedding and rerank models (kind "embedding" / "rerank"), shared by every tenant.
        + request.app.state.embeddings.cards(_STARTED)
    )


@router.get("/v1/capabilities", response_model=Capabilities)
async def capabilities(request: Request) -> Capabilities:
    """Tandem extension: what can be published here (the trainer asks before training)."""
    return Capabilities(**_registry(request).capabilities())


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    for card in (await list_models(request)).data:
        if card.id == model_id:
            return card
    raise NotFound(f"The model `{model_id}` does not exist.", param="model", code="model_not_found")


@router.delete("/v1/models/{model_id:path}")
async def delete_model(model_id: str, request: Request) -> dict[str, Any]:
    """Remove a fine-tune (adapter or registered model) from every replica: its tenant or an
    operator. The weights stay with the trainer job that made them."""
    try:
        rec = await _registry(request).remove(model_id, principal_of(request))
    except EngineError as exc:
        raise _not_found(exc, "model") from None
    return {"id": model_id, "object": "model", "deleted": True, "kind": _kind(rec.kind if rec else "adapter")}


def _kind(kind: str) -> str:
    return "registered" if kind == "model" else kind


def _not_found(exc: EngineError, param: str) -> Exception:
    err = http_error(exc)
    if err.status_code == 404:
        err.param = param
    return err


@router.post("/v1/chat/completions", response_model=None, responses=JSON_OR_SSE)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    return await OpenAIServing(_registry(request)).chat(body, request)


@router.post("/v1/completions", response_model=None, responses=JSON_OR_SSE)
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    return await OpenAIServing(_registry(request)).completions(body, request)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraRequest, request: Request) -> dict[str, Any]:
    """Operator: record an adapter (for ``tenant``, or shared) and load it; every replica
    serves it from now on, after restarts too."""
    require_operator(request)
    registry = _registry(request)
    path = _server_path(request, body.lora_path, "lora_path")
    try:
        await registry.load_adapter(body.lora_name, path, body.tenant or "", body.base)
    except KeyError:
        raise Conflict(f"lora_name {body.lora_name!r} is already served", param="lora_name") from None
    except EngineError as exc:
        if "already loaded" in str(exc):
            raise Conflict(str(exc), param="lora_name") from None
        raise _not_found(exc, "base") from None
    out: dict[str, Any] = {"status": "loaded", "lora_name": body.lora_name, "lora_path": str(path)}
    if body.tenant:
        out["tenant"] = body.tenant
    return out


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraRequest, request: Request) -> dict[str, Any]:
    """Remove an adapter everywhere (its record too): an operator, or the owning tenant."""
    try:
        await _registry(request).remove(body.lora_name, principal_of(request), kind="adapter")
    except EngineError as exc:
        if "no adapter named" in str(exc) or "does not exist" in str(exc):
            raise NotFound(str(exc), param="lora_name", code="adapter_not_found") from None
        raise http_error(exc) from None
    return {"status": "unloaded", "lora_name": body.lora_name}


@router.post("/v1/models/register")
async def register_model(body: RegisterModelRequest, request: Request) -> ModelCard:
    """Tandem extension (operator): serve a full fine-tuned model folder (or .gguf) under
    ``name``, for ``tenant`` or shared; recorded durably like adapters."""
    require_operator(request)
    registry = _registry(request)
    path = _server_path(request, body.path, "path")
    try:
        await registry.register(body.name, path, body.tenant or "")
    except KeyError:
        raise Conflict(f"a model named {body.name!r} is already served", param="name") from None
    except EngineError as exc:
        err = http_error(exc)
        if err.status_code == 503:  # the weights did not load: the path's fault
            raise InvalidRequest(
                f"path {body.path!r} could not be loaded as a model: {exc}", param="path"
            ) from None
        raise err from None
    return ModelCard(
        id=body.name,
        created=int(time.time()),
        root=str(path),
        kind="registered",
        owned_by=body.tenant or "tandem",
    )


@router.post("/v1/models/unregister")
async def unregister_model(body: UnregisterModelRequest, request: Request) -> dict[str, Any]:
    """Remove a registered model everywhere: an operator, or the owning tenant."""
    try:
        await _registry(request).remove(body.name, principal_of(request), kind="model")
    except EngineError as exc:
        raise _not_found(exc, "name") from None
    return {"status": "unregistered", "name": body.name}
