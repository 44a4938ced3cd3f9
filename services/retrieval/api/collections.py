"""``/v1/collections``: create, list, show, delete."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from services.common.errors import InvalidRequest
from services.common.idempotency import idempotent
from services.retrieval.api.deps import CollectionDep, CollectionName, ManagerDep, TenantDep
from services.retrieval.core.collection import CollectionConfig
from services.retrieval.core.jobs import TASK_NAME
from services.retrieval.core.ocr import check_language
from services.retrieval.protocol import (
    Chunking,
    CollectionInfo,
    CollectionList,
    CreateCollection,
    ReindexResponse,
    UpdateCollection,
)
from services.retrieval.reindex import rollback, start_reindex

router = APIRouter(
    prefix="/v1/collections", tags=["collections"], responses={404: {"description": "no such collection"}}
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
        return 201, (await run_in_threadpool(make)).model_dump(mode="json")

    return await idempotent(request, who, create)


@router.get("", response_model=CollectionList)
def list_collections(who: TenantDep, collections: ManagerDep) -> CollectionList:
    return CollectionList(collections=[_info(c) for c in collections.list(who)])


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
def delete_collection(name: CollectionName, who: TenantDep, collections: ManagerDep) -> Response:
    collections.delete(who, name)
    return Response(status_code=204)
