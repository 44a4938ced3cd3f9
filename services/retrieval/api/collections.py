"""``/v1/collections``: create, list, show, delete; and a collection's access list
(``/v1/collections/{name}/access``, services/common/access.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from services.common.access import (
    AccessList,
    StoredAccess,
    as_detail,
    check_known,
    may_read,
    may_write,
    normal,
)
from services.common.audit import audit_request
from services.common.auth import acting_principal, require_admin
from services.common.errors import InvalidRequest
from services.common.idempotency import idempotent
from services.retrieval.api.deps import (
    AccessDep,
    CollectionDep,
    CollectionName,
    ManagerDep,
    TenantDep,
    access_store,
    cannot_write,
    check_access,
)
from services.retrieval.core.collection import CollectionConfig
from services.retrieval.core.jobs import TASK_NAME
from services.retrieval.core.ocr import check_language
from services.retrieval.protocol import (
    Chunking,
    CollectionAccess,
    CollectionInfo,
    CollectionList,
    CreateCollection,
    ReindexResponse,
    UpdateCollection,
)
from services.retrieval.reindex import rollback, start_reindex

router = APIRouter(
    prefix="/v1/collections",
    tags=["collections"],
    responses={
        403: {"description": "the caller may read the collection but not write it (the message names it)"},
        404: {"description": "no such collection (or one the caller may not read)"},
    },
    dependencies=[Depends(check_access)],
)


def _info(config: CollectionConfig, stats: dict[str, object] | None = None) -> CollectionInfo:
    # ``stats`` may carry the active index version's dimension (after a switch of embedder).
    fields: dict[str, object] = {"dimension": config.dim, **(stats or {})}
    return CollectionInfo(
        name=config.name,
        embedding_model=config.embedding_model,
        embedding_backend=config.embedding_backend,
        chunking=Chunking(size=config.chunk_size, overlap=config.chunk_overlap),
        keep_hidden_text=config.keep_hidden_text,
        ocr_language=config.ocr_language,
        index=config.index,
        created_at=config.created_at,
        **fields,  # type: ignore[arg-type]
    )


@router.post(
    "",
    status_code=201,
    response_model=CollectionInfo,
    responses={
        400: {
            "description": "invalid name, model, chunking, embedding_backend or ocr_language (the message "
            "names the field and value)"
        },
        401: {"description": "missing or unknown API key"},
        409: {
            "description": "the collection exists, or the Idempotency-Key was used with a different request"
        },
    },
)
async def create_collection(
    body: CreateCollection, request: Request, who: TenantDep, collections: ManagerDep
) -> Any:
    """Create a collection; with an ``Idempotency-Key`` header a retry returns the first answer
    (not a 409 for the collection the first request made)."""

    def make() -> CollectionInfo:
        config = collections.create(
            who,
            body.name,
            embedding_model=body.embedding_model,
            chunk_size=body.chunking.size if body.chunking else None,
            chunk_overlap=body.chunking.overlap if body.chunking else None,
            index=body.index,
            embedding_backend=body.embedding_backend,
            keep_hidden_text=body.keep_hidden_text,
            ocr_language=body.ocr_language,
        )
        return _info(config, {"documents": 0, "chunks": 0})

    async def create() -> tuple[int, Any]:
        made = await run_in_threadpool(make)
        # a list left by an earlier collection of this name is not the new one's
        await access_store(request).delete(who, body.name)
        return 201, made.model_dump(mode="json")

    return await idempotent(request, who, create)


@router.get("", response_model=CollectionList)
async def list_collections(request: Request, collections: ManagerDep) -> CollectionList:
    """The tenant's collections that the caller may read."""
    principal = acting_principal(request)
    configs = await run_in_threadpool(collections.list, principal.tenant)
    lists = await access_store(request).all(principal.tenant)
    return CollectionList(collections=[_info(c) for c in configs if may_read(principal, lists.get(c.name))])


@router.get("/{name}", response_model=CollectionInfo)
def get_collection(col: CollectionDep) -> CollectionInfo:
    return _info(col.config, col.stats())


VERSION_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "no or an unknown field, or an embedder that is no base model"},
    401: {"description": "missing or unknown API key"},
    404: {"description": "no such collection, or no such fine-tuned embedder of this tenant"},
    409: {
        "description": "a reindex is running, no previous version to roll back to, or an embedder's "
        "dimension differs from its index version's"
    },
    501: {"description": "the backend (milvus) has no index versions yet"},
}


@router.patch(
    "/{name}",
    status_code=202,
    response_model=ReindexResponse,
    responses={
        **VERSION_ERRORS,
        400: {
            "description": "no or an unknown field, an embedder that is no base model, or an unknown ocr_language"
        },
        200: {
            "model": CollectionInfo,
            "description": "only ocr_language was given: the collection as it is now",
        },
    },
)
def update_collection(
    name: CollectionName, body: UpdateCollection, request: Request, who: TenantDep, collections: ManagerDep
) -> Any:
    """Switch the collection to another embedder (a base model, or one of the tenant's
    fine-tuned ``ft-emb-...``): a job re-embeds every chunk into a new index version while
    searches answer from the current one, then switches atomically; the version left is kept
    for ``POST /v1/collections/{name}/rollback``. ``ocr_language`` changes the language OCR
    reads in files ingested from now on, at once; given alone, the answer is 200 with the
    collection."""
    if body.embedder is None and body.ocr_language is None:
        raise InvalidRequest(
            "nothing to change: give 'embedder' (the name of a base model or fine-tuned embedder) "
            "or 'ocr_language'",
            param="embedder",
        )
    if body.ocr_language is not None:
        check_language(body.ocr_language)  # before a reindex starts, so a bad value changes nothing
    started = None
    if body.embedder is not None:
        celery = request.app.state.celery

        def dispatch(tenant: str, collection: str, job_id: str) -> None:
            celery.send_task(TASK_NAME, args=[tenant, collection, job_id], queue="io")

        started = start_reindex(
            collections, request.app.state.jobs, who, name, body.embedder, dispatch, body.only_if_better
        )
    elif body.only_if_better is not None:
        raise InvalidRequest("only_if_better goes with an 'embedder' to switch to", param="only_if_better")
    if body.ocr_language is not None:
        collections.set_ocr_language(who, name, body.ocr_language)
    if started is not None:
        return started
    col = collections.get(who, name)
    return JSONResponse(_info(col.config, col.stats()).model_dump(mode="json"), status_code=200)


@router.post("/{name}/rollback", response_model=CollectionInfo, responses=VERSION_ERRORS)
def rollback_collection(
    name: CollectionName, request: Request, who: TenantDep, collections: ManagerDep
) -> CollectionInfo:
    """Switch back to the previous index version, atomically (chunks ingested since the switch
    are embedded with its embedder first). The version left becomes the previous one."""
    rollback(collections, request.app.state.jobs, who, name)
    col = collections.get(who, name)
    return _info(col.config, col.stats())


@router.delete("/{name}", status_code=204)
async def delete_collection(
    name: CollectionName, request: Request, who: TenantDep, collections: ManagerDep
) -> Response:
    await run_in_threadpool(collections.delete, who, name)
    await access_store(request).delete(who, name)
    return Response(status_code=204)


def _access(name: str, acl: StoredAccess | None) -> CollectionAccess:
    if acl is None:
        return CollectionAccess(collection=name, open=True, readers=[], writers=[], updated_at=None)
    return CollectionAccess(
        collection=name, open=False, readers=acl.readers, writers=acl.writers, updated_at=acl.updated_at
    )


ACCESS_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"description": "missing or unknown API key"},
    403: {"description": "not an admin (GET: not an admin or a writer of the collection)"},
    404: {
        "description": "no such collection (or one the caller may not read); for PUT also an entry "
        "naming no user, group or live key of the tenant (the message names it)"
    },
}


@router.get("/{name}/access", response_model=CollectionAccess, responses=ACCESS_ERRORS)
async def get_access(
    name: CollectionName, request: Request, acl: AccessDep, collections: ManagerDep
) -> CollectionAccess:
    """Who may read and who may write the collection (``open``: no list, the whole tenant).
    Admins and the collection's writers may ask."""
    principal = acting_principal(request)
    if not may_write(principal, acl):
        raise cannot_write(principal, name, f"GET /v1/collections/{name}/access")
    await run_in_threadpool(collections.config, principal.tenant, name)  # 404 if missing
    return _access(name, acl)


@router.put(
    "/{name}/access",
    response_model=CollectionAccess,
    responses={**ACCESS_ERRORS, 400: {"description": "a malformed entry (the message names it)"}},
)
async def put_access(
    name: CollectionName, body: AccessList, request: Request, acl: AccessDep, collections: ManagerDep
) -> CollectionAccess:
    """Set who may read and who may write the collection (admins only): entries
    ``user:<id>``, ``group:<name>``, ``key:<id>``; writers read too, and the tenant's admins
    read and write every collection. Recorded in the audit log as ``collection.access``."""
    principal = acting_principal(request)
    require_admin(principal, f"PUT /v1/collections/{name}/access")
    await run_in_threadpool(collections.config, principal.tenant, name)  # 404 if missing
    wanted = normal(body)
    await check_known(request.app.state.redis, principal.tenant, wanted, acl)
    stored = await access_store(request).put(principal.tenant, name, wanted)
    await audit_request(
        request, "collection.access", name, {"before": as_detail(acl), "after": as_detail(stored)}
    )
    return _access(name, stored)


@router.delete("/{name}/access", status_code=204, responses=ACCESS_ERRORS)
async def delete_access(
    name: CollectionName, request: Request, acl: AccessDep, collections: ManagerDep
) -> Response:
    """Remove the list: the collection is open to the whole tenant again (admins only)."""
    principal = acting_principal(request)
    require_admin(principal, f"DELETE /v1/collections/{name}/access")
    await run_in_threadpool(collections.config, principal.tenant, name)  # 404 if missing
    before = await access_store(request).delete(principal.tenant, name)
    if before is not None:
        await audit_request(request, "collection.access", name, {"before": as_detail(before), "after": None})
    return Response(status_code=204)
