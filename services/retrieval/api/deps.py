"""What every router needs, as ``Annotated`` dependencies (the FastAPI full-stack template's
style): the caller's tenant, the collection manager, the settings and the named collection."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request

from services.common.auth import acting_principal
from services.retrieval.config import RetrievalSettings
from services.retrieval.core.collection import ChunkedCollection
from services.retrieval.core.registry import CollectionManager


def manager(request: Request) -> CollectionManager:
    return request.app.state.collections  # type: ignore[no-any-return]


def tenant(request: Request) -> str:
    """The caller's tenant; an operator key sending ``X-Tandem-Tenant`` acts for that tenant (the
    trainer's worker switching a tenant's collection to its tuned embedder)."""
    return acting_principal(request).tenant


def settings(request: Request) -> RetrievalSettings:
    return request.app.state.settings  # type: ignore[no-any-return]


def collection(request: Request, name: str) -> ChunkedCollection:
    """The caller's collection ``name``; another tenant's is not visible (404)."""
    return manager(request).get(tenant(request), name)


ManagerDep = Annotated[CollectionManager, Depends(manager)]
TenantDep = Annotated[str, Depends(tenant)]
SettingsDep = Annotated[RetrievalSettings, Depends(settings)]
CollectionName = Annotated[str, Path(description="Collection name (1-64 letters, digits, '_', '.', '-')")]


def _named_collection(request: Request, name: CollectionName) -> ChunkedCollection:
    return collection(request, name)


# Opening a collection reads files or asks the backend: a sync dependency runs in the threadpool.
CollectionDep = Annotated[ChunkedCollection, Depends(_named_collection)]
