"""``/v1/collections``: create, list, show, delete."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from services.common.idempotency import idempotent
from services.retrieval.api.deps import CollectionDep, CollectionName, ManagerDep, TenantDep
from services.retrieval.core.collection import CollectionConfig
from services.retrieval.protocol import Chunking, CollectionInfo, CollectionList, CreateCollection

router = APIRouter(
    prefix="/v1/collections", tags=["collections"], responses={404: {"description": "no such collection"}}
)


def _info(config: CollectionConfig, stats: dict[str, object] | None = None) -> CollectionInfo:
    return CollectionInfo(
        name=config.name,
        embedding_model=config.embedding_model,
        embedding_backend=config.embedding_backend,
        dimension=config.dim,
        chunking=Chunking(size=config.chunk_size, overlap=config.chunk_overlap),
        index=config.index,
        created_at=config.created_at,
        **(stats or {}),  # type: ignore[arg-type]
    )


@router.post(
    "",
    status_code=201,
    response_model=CollectionInfo,
    responses={
        400: {
            "description": "invalid name, model, chunking or embedding_backend (the message names the field and value)"
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


@router.delete("/{name}", status_code=204)
def delete_collection(name: CollectionName, who: TenantDep, collections: ManagerDep) -> Response:
    collections.delete(who, name)
    return Response(status_code=204)
