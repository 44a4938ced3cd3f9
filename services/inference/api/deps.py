"""What the routers need, as ``Annotated`` dependencies (the FastAPI full-stack template's
way): a route names ``RegistryDep``, ``ServingDep``... and FastAPI builds it per request."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from services.common.auth import Principal, acting_principal, principal_of, require_operator
from services.common.errors import ServiceUnavailable
from services.inference.embeddings import EmbeddingService, ReaderScope
from services.inference.management import ModelAdmin
from services.inference.registry import ModelRegistry
from services.inference.serving import OpenAIServing


def registry(request: Request) -> ModelRegistry:
    """The model registry; 503 until the lifespan has loaded the model."""
    found: ModelRegistry | None = getattr(request.app.state, "registry", None)
    if found is None:
        raise ServiceUnavailable("the model is still loading")
    return found


def embeddings(request: Request) -> EmbeddingService:
    found: EmbeddingService | None = getattr(request.app.state, "embeddings", None)
    if found is None:
        raise ServiceUnavailable("the server is starting")
    return found


RegistryDep = Annotated[ModelRegistry, Depends(registry)]
EmbeddingsDep = Annotated[EmbeddingService, Depends(embeddings)]
# the caller (any key), or an operator (403 ``forbidden`` for a tenant key)
CallerDep = Annotated[Principal, Depends(principal_of)]
OperatorDep = Annotated[Principal, Depends(require_operator)]


def reader_scope(request: Request) -> ReaderScope:
    """The published readers the caller may use: its tenant's (an operator acting for a tenant,
    ``X-Tandem-Tenant``, that tenant's), then the shared ones."""
    return ReaderScope(request.app.state.common.home_dir, acting_principal(request).tenant)


ReaderScopeDep = Annotated[ReaderScope, Depends(reader_scope)]


def serving(registry: RegistryDep) -> OpenAIServing:
    return OpenAIServing(registry)


def model_admin(request: Request, registry: RegistryDep, embeddings: EmbeddingsDep) -> ModelAdmin:
    return ModelAdmin(registry, embeddings, request.app.state.common.allowed_model_roots)


ServingDep = Annotated[OpenAIServing, Depends(serving)]
ModelAdminDep = Annotated[ModelAdmin, Depends(model_admin)]
