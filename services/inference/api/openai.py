"""OpenAI-compatible routes plus vLLM's adapter routes and Tandem's model registration (thin)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common.errors import Conflict, InvalidRequest, NotFound
from services.common.paths import resolve_under_roots
from services.inference.engine.types import EngineError, UnknownModel
from services.inference.protocol import (
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

router = APIRouter(tags=["openai"])
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
    try:
        served = await _registry(request).models()
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
            )
            for m in served
        ]
    )


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    for card in (await list_models(request)).data:
        if card.id == model_id:
            return card
    raise NotFound(f"The model `{model_id}` does not exist.", param="model", code="model_not_found")


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    return await OpenAIServing(_registry(request)).chat(body, request)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    return await OpenAIServing(_registry(request)).completions(body, request)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraRequest, request: Request) -> dict[str, Any]:
    registry = _registry(request)
    path = _server_path(request, body.lora_path, "lora_path")
    if body.lora_name in registry.registered:
        raise Conflict(f"lora_name {body.lora_name!r} is already a registered model", param="lora_name")
    try:
        await registry.primary.load_adapter(body.lora_name, str(path))
    except EngineError as exc:
        if "already loaded" in str(exc):
            raise Conflict(str(exc), param="lora_name") from None
        raise http_error(exc) from None
    return {"status": "loaded", "lora_name": body.lora_name, "lora_path": str(path)}


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraRequest, request: Request) -> dict[str, Any]:
    try:
        await _registry(request).primary.unload_adapter(body.lora_name)
    except EngineError as exc:
        if "no adapter named" in str(exc):
            raise NotFound(str(exc), param="lora_name", code="adapter_not_found") from None
        raise http_error(exc) from None
    return {"status": "unloaded", "lora_name": body.lora_name}


@router.post("/v1/models/register")
async def register_model(body: RegisterModelRequest, request: Request) -> ModelCard:
    """Tandem extension: serve a full fine-tuned model folder (or .gguf) under ``name``."""
    registry = _registry(request)
    path = _server_path(request, body.path, "path")
    try:
        await registry.register(body.name, path)
    except KeyError:
        raise Conflict(f"a model named {body.name!r} is already served", param="name") from None
    except EngineError as exc:
        raise http_error(exc) from None
    except (OSError, ValueError) as exc:
        raise InvalidRequest(
            f"path {body.path!r} could not be loaded as a model: {exc}", param="path"
        ) from None
    return ModelCard(id=body.name, created=int(time.time()), root=str(path))


@router.post("/v1/models/unregister")
async def unregister_model(body: UnregisterModelRequest, request: Request) -> dict[str, Any]:
    try:
        await _registry(request).unregister(body.name)
    except UnknownModel as exc:
        raise NotFound(str(exc), param="name", code="model_not_found") from None
    return {"status": "unregistered", "name": body.name}
