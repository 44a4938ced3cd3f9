"""OpenAI-compatible routes plus vLLM's adapter routes and Tandem's model registration (thin:
the logic is in ``serving.OpenAIServing`` and ``management.ModelAdmin``).

Roles: loading adapters and registering models (for any tenant, or shared) needs an
operator key; unloading, unregistering and ``DELETE /v1/models/{name}`` take an operator
key or the owning tenant's. Everything else takes any key, and sees shared models plus
the caller's own.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from services.common.app_factory import json_or_sse
from services.common.errors import ServiceUnavailable
from services.common.openai_wire import ChatCompletion, ModelCard, ModelList, TextCompletion
from services.inference.api.deps import (
    CallerDep,
    EmbeddingsDep,
    ModelAdminDep,
    OperatorDep,
    ReaderScopeDep,
    ServingDep,
)
from services.inference.engine.types import EngineError
from services.inference.protocol import (
    AdapterLoaded,
    AdapterUnloaded,
    Capabilities,
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraRequest,
    ModelDeleted,
    ModelUnregistered,
    RegisterModelRequest,
    UnloadLoraRequest,
    UnregisterModelRequest,
)
from services.inference.serving import http_error

router = APIRouter(
    tags=["openai"],
    responses={
        403: {"description": "an operator route called without an operator key, or another tenant's model"},
        404: {"description": "no such model or adapter"},
        409: {"description": "a model or adapter of that name is already served"},
        503: {"description": "the model is still loading, or could not be loaded"},
    },
)


@router.get("/v1/models", response_model=ModelList)
async def list_models(
    admin: ModelAdminDep, caller: CallerDep, embeddings: EmbeddingsDep, readers: ReaderScopeDep
) -> ModelList:
    """The served base models, shared fine-tunes, and the caller tenant's own; its published
    readers (and the shared ones) as ``kind: "rerank"`` with their ``threshold``."""
    listed = await admin.list(caller)
    listed.data += await run_in_threadpool(embeddings.reader_cards, readers)
    return listed


@router.get("/v1/capabilities", response_model=Capabilities)
async def capabilities(admin: ModelAdminDep) -> Capabilities:
    """Tandem extension: what can be published here (the trainer asks before training)."""
    return admin.capabilities()


@router.get("/health")
async def health(request: Request, _caller: CallerDep) -> dict[str, object]:
    """Tandem extension: the served engine's state (its load; for the torch and llama.cpp
    engines its loop's steps and seconds since the last one, and for torch its forward plan,
    ``forward_plan``); 503 with the reason while the model is loading, or when the engine is
    down, its loop died, or its loop has left requests waiting past ``TANDEM_INFERENCE_STALL_S``."""
    registry = getattr(request.app.state, "registry", None)
    if registry is None:
        raise ServiceUnavailable("the model is still loading")
    try:
        return await registry.primary.health()
    except EngineError as exc:
        raise http_error(exc) from None


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def retrieve_model(
    model_id: str, admin: ModelAdminDep, caller: CallerDep, embeddings: EmbeddingsDep, readers: ReaderScopeDep
) -> ModelCard:
    for card in await run_in_threadpool(embeddings.reader_cards, readers):
        if card.id == model_id:
            return card
    return await admin.card(model_id, caller)


@router.delete("/v1/models/{model_id:path}", response_model=ModelDeleted)
async def delete_model(model_id: str, admin: ModelAdminDep, caller: CallerDep) -> ModelDeleted:
    """Remove a fine-tune (adapter or registered model) from every replica: its tenant or an
    operator. The weights stay with the trainer job that made them."""
    return await admin.delete(model_id, caller)


# Not response models (a route returns either JSON or an SSE stream): documented as responses.
@router.post("/v1/chat/completions", response_model=None, responses=json_or_sse(ChatCompletion))
async def chat_completions(
    body: ChatCompletionRequest, serving: ServingDep, request: Request
) -> JSONResponse | StreamingResponse:
    return await serving.chat(body, request)


@router.post("/v1/completions", response_model=None, responses=json_or_sse(TextCompletion))
async def completions(
    body: CompletionRequest, serving: ServingDep, request: Request
) -> JSONResponse | StreamingResponse:
    return await serving.completions(body, request)


@router.post("/v1/load_lora_adapter", response_model=AdapterLoaded, response_model_exclude_none=True)
async def load_lora_adapter(body: LoadLoraRequest, _: OperatorDep, admin: ModelAdminDep) -> AdapterLoaded:
    """Operator: record an adapter (for ``tenant``, or shared) and load it; every replica
    serves it from now on, after restarts too."""
    return await admin.load_adapter(body)


@router.post("/v1/unload_lora_adapter", response_model=AdapterUnloaded)
async def unload_lora_adapter(
    body: UnloadLoraRequest, admin: ModelAdminDep, caller: CallerDep
) -> AdapterUnloaded:
    """Remove an adapter everywhere (its record too; requests still running on it end with an
    error): an operator, or the owning tenant."""
    return await admin.unload_adapter(body, caller)


@router.post("/v1/models/register", response_model=ModelCard)
async def register_model(body: RegisterModelRequest, _: OperatorDep, admin: ModelAdminDep) -> ModelCard:
    """Tandem extension (operator): serve a full fine-tuned model folder (or .gguf) under
    ``name``, for ``tenant`` or shared; recorded durably like adapters."""
    return await admin.register(body)


@router.post("/v1/models/unregister", response_model=ModelUnregistered)
async def unregister_model(
    body: UnregisterModelRequest, admin: ModelAdminDep, caller: CallerDep
) -> ModelUnregistered:
    """Remove a registered model everywhere: an operator, or the owning tenant."""
    return await admin.unregister(body, caller)
