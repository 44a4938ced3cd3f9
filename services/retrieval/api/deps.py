"""What every router needs, as ``Annotated`` dependencies (the FastAPI full-stack template's
style): the caller's tenant, the collection manager, the settings and the named collection;
and ``check_access``, every collection router's own dependency, which applies the collection's
access list (services/common/access.py) before a route does any work."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request

from services.common.access import AccessStore, StoredAccess, may_read, may_write
from services.common.auth import SAFE_METHODS, Principal, acting_principal
from services.common.errors import Forbidden
from services.retrieval.config import RetrievalSettings
from services.retrieval.core.backend import not_found
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


def access_store(request: Request) -> AccessStore:
    return request.app.state.access  # type: ignore[no-any-return]


# Routes that take a body (POST) and only read.
READ_POSTS = ("/search", "/embed")


async def check_access(request: Request) -> StoredAccess | None:
    """The access list of the collection in the path (None: open to the tenant), applied: a
    caller who may not read the collection gets the 404 of a missing one, and one who may read
    but not write gets a 403 naming it on a route that writes."""
    name = request.path_params.get("name")
    if not isinstance(name, str):
        return None
    principal = acting_principal(request)
    acl = await access_store(request).get(principal.tenant, name)
    check_readable(principal, name, acl)
    template = str(getattr(request.scope.get("route"), "path", request.url.path))
    writes = request.method.upper() not in SAFE_METHODS and not template.endswith(READ_POSTS)
    if writes and not may_write(principal, acl):
        raise cannot_write(principal, name, f"{request.method.upper()} {template}")
    return acl


def check_readable(principal: Principal, name: str, acl: StoredAccess | None) -> None:
    """404 as for a missing collection when ``principal`` may not read ``name``."""
    if not may_read(principal, acl):
        raise not_found(name)


def cannot_write(principal: Principal, name: str, what: str) -> Forbidden:
    holder = f"user {principal.user_id}" if principal.user_id else f"key {principal.key_id}"
    return Forbidden(
        f"{what}: {holder} may read collection {name!r} but not write it (it is not among the "
        f"collection's writers; an admin changes that with PUT /v1/collections/{name}/access)",
        param="name",
        code="collection_read_only",
    )


AccessDep = Annotated[StoredAccess | None, Depends(check_access)]
ManagerDep = Annotated[CollectionManager, Depends(manager)]
TenantDep = Annotated[str, Depends(tenant)]
SettingsDep = Annotated[RetrievalSettings, Depends(settings)]
CollectionName = Annotated[str, Path(description="Collection name (1-64 letters, digits, '_', '.', '-')")]


def _named_collection(request: Request, name: CollectionName) -> ChunkedCollection:
    return collection(request, name)


# Opening a collection reads files or asks the backend: a sync dependency runs in the threadpool.
CollectionDep = Annotated[ChunkedCollection, Depends(_named_collection)]
