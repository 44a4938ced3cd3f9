"""``/v1/collections/{name}/sources``: the Git repositories, websites and folders a collection
follows, and their syncs (services/retrieval/sources/)."""

from __future__ import annotations

import shutil
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from services.common.audit import audit_request
from services.common.idempotency import RESPONSES as IDEMPOTENCY_RESPONSES
from services.common.idempotency import idempotent
from services.retrieval.api.deps import CollectionName, check_access, collection, settings, tenant
from services.retrieval.core.collection import ChunkedCollection
from services.retrieval.core.jobs import TASK_NAME
from services.retrieval.protocol import CreateSource, LastSync, SourceInfo, SourceList, SyncStarted
from services.retrieval.sources.checks import new_source
from services.retrieval.sources.schedule import job_busy, start_sync
from services.retrieval.sources.store import CACHE_DIR, Source, SourceStore

router = APIRouter(prefix="/v1/collections", tags=["sources"], dependencies=[Depends(check_access)])

SourceId = Annotated[str, Path(max_length=64, description="The source's id (src_...)")]

Responses = dict[int | str, dict[str, Any]]
NOT_FOUND: Responses = {
    404: {"description": "no such collection, or no such source in it (the message names it)"}
}
UNAUTHORIZED: Responses = {401: {"description": "missing or unknown API key"}}


def _store(col: ChunkedCollection) -> SourceStore:
    return SourceStore(col.root, col.config.name)


def _info(store: SourceStore, source: Source, request: Request) -> SourceInfo:
    files, documents = store.counts(source.id)
    running = source.running_job
    return SourceInfo(
        id=source.id,
        collection=store.collection,
        type=source.type,
        url=source.url,
        branch=source.branch,
        paths=source.paths,
        interval_minutes=source.interval_minutes,
        created_at=source.created_at,
        next_sync_at=source.next_sync_at,
        last_sync=LastSync.model_validate(source.last_sync) if source.last_sync else None,
        syncing_job=running if running and job_busy(request.app.state.jobs, running) else None,
        files=files,
        documents=documents,
    )


@router.post(
    "/{name}/sources",
    status_code=201,
    response_model=SourceInfo,
    responses={
        400: {
            "description": "an unknown type, a bad URL, glob, branch or interval, a path outside "
            "TANDEM_RETRIEVAL_SOURCE_ROOTS, or a private address (the message names the field and value)"
        },
        **UNAUTHORIZED,
        403: {"description": "the caller may not change collections (a viewer)"},
        **NOT_FOUND,
        409: {
            "description": "the collection already follows this source, or as many sources as it may; "
            "or the Idempotency-Key was used with a different request"
        },
        **IDEMPOTENCY_RESPONSES,
    },
)
async def add_source(name: CollectionName, body: CreateSource, request: Request) -> Any:
    """Follow a Git repository, a website or a server folder. The source is stored before the
    answer; its first sync is due at once (the scheduler starts it within a minute), or start
    one with ``POST .../sources/{id}/sync``. With an ``Idempotency-Key`` header a retry returns
    the first answer."""
    who = tenant(request)

    async def create() -> tuple[int, Any]:
        col = await run_in_threadpool(collection, request, name)  # 404 before any work
        source = await new_source(body, settings(request), time.time())
        store = _store(col)
        await run_in_threadpool(store.add, source, settings(request).source_max_per_collection)
        info = await run_in_threadpool(_info, store, source, request)
        await audit_request(
            request, "source.add", name, {"source": source.id, "type": source.type, "url": source.url}
        )
        return 201, info.model_dump(mode="json")

    return await idempotent(request, who, create)


@router.get("/{name}/sources", response_model=SourceList, responses={**UNAUTHORIZED, **NOT_FOUND})
def list_sources(name: CollectionName, request: Request) -> SourceList:
    store = _store(collection(request, name))
    return SourceList(sources=[_info(store, s, request) for s in store.all()])


@router.get("/{name}/sources/{source_id}", response_model=SourceInfo, responses={**UNAUTHORIZED, **NOT_FOUND})
def get_source(name: CollectionName, source_id: SourceId, request: Request) -> SourceInfo:
    store = _store(collection(request, name))
    return _info(store, store.get(source_id), request)


@router.delete(
    "/{name}/sources/{source_id}",
    status_code=204,
    responses={
        **UNAUTHORIZED,
        403: {"description": "the caller may not change collections (a viewer)"},
        **NOT_FOUND,
        409: {"description": "the source is syncing; delete it after its job ends"},
    },
)
async def delete_source(
    name: CollectionName,
    source_id: SourceId,
    request: Request,
    keep_documents: Annotated[
        bool, Query(description="Keep the documents the source gave (they are no longer synced).")
    ] = False,
) -> Response:
    """Stop following the source; the documents it gave leave the collection too, unless
    ``keep_documents``."""

    def delete() -> int:
        col = collection(request, name)
        jobs = request.app.state.jobs
        doc_ids = _store(col).delete(source_id, lambda j: job_busy(jobs, j))
        if not keep_documents:
            for doc_id in doc_ids:
                col.delete_document(doc_id)
        shutil.rmtree(col.root / CACHE_DIR / source_id, ignore_errors=True)
        return len(doc_ids)

    documents = await run_in_threadpool(delete)
    await audit_request(
        request, "source.delete", name, {"source": source_id, "documents": documents, "kept": keep_documents}
    )
    return Response(status_code=204)


@router.post(
    "/{name}/sources/{source_id}/sync",
    status_code=202,
    response_model=SyncStarted,
    responses={
        **UNAUTHORIZED,
        403: {"description": "the caller may not change collections (a viewer)"},
        **NOT_FOUND,
    },
)
async def sync_source(name: CollectionName, source_id: SourceId, request: Request) -> SyncStarted:
    """Sync the source now: a job (``GET /v1/jobs/{job_id}``) whose ``result`` counts the files
    ``added``, ``changed``, ``removed``, ``failed`` and ``unchanged``, with an error per file that
    failed. While the source syncs already, that job is the answer (``already_running``)."""
    who = tenant(request)
    celery = request.app.state.celery

    def dispatch(tenant_name: str, collection_name: str, job_id: str) -> None:
        celery.send_task(TASK_NAME, args=[tenant_name, collection_name, job_id], queue="io")

    def start() -> tuple[str, bool]:
        store = _store(collection(request, name))
        return start_sync(store, request.app.state.jobs, who, name, store.get(source_id), dispatch)

    job_id, already = await run_in_threadpool(start)
    if not already:
        await audit_request(request, "source.sync", name, {"source": source_id, "job": job_id})
    return SyncStarted(
        job_id=job_id,
        source_id=source_id,
        already_running=already,
        status_url=f"/v1/jobs/{job_id}",
        events_url=f"/v1/jobs/{job_id}/events",
    )
