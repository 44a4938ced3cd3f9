"""What every router needs: the caller's tenant and the collection manager."""

from __future__ import annotations

from fastapi import Request

from services.common.auth import principal_of
from services.retrieval.core.collection import Collection
from services.retrieval.core.registry import CollectionManager


def manager(request: Request) -> CollectionManager:
    return request.app.state.collections  # type: ignore[no-any-return]


def tenant(request: Request) -> str:
    return principal_of(request).tenant


def collection(request: Request, name: str) -> Collection:
    """The caller's collection ``name``; another tenant's is not visible (404)."""
    return manager(request).get(tenant(request), name)
