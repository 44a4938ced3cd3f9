"""``/v1/collections``: create, list, show, delete."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from services.common.idempotency import idempotent
from services.retrieval.api.deps import manager, tenant
from services.retrieval.core.collection import CollectionConfig
from services.retrieval.protocol import Chunking, CollectionInfo, CollectionList, CreateCollection

router = APIRouter(
    prefix="/v1/collections", tags=["collections"], responses={404: {"description": "no such collection"}}
)


def _info(config: CollectionConfig, stats: dict[str, object] | None = None) -> CollectionInfo:
    return CollectionInfo(
        name=config.name,
        embedding_model=config.embedding_model,
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
        400: {"description": "invalid name, model or chunking (the message names the field and value)"},
        401: {"description": "missing or unknown API key"},
        409: {
            "description": "the collection exists, or the Idempotency-Key was used with a different request"
        },
    },
)
async def create_collection(body: CreateCollection, request: Request) -> Any:
    """Create a collection; with an ``Idempotency-Key`` header a retry returns the first answer
    (not a 409 for the collection the first request made)."""
    who = tenant(request)

    def make() -> CollectionInfo:
        config = manager(request).create(
            who,
            body.name,
            embedding_model=body.embedding_model,
            chunk_size=body.chunking.size if body.chunking else None,
            chunk_overlap=body.chunking.overlap if body.chunking else None,
            index=body.index,
        )
        return _info(config, {"documents": 0, "chunks": 0})

    async def create() -> tuple[int, Any]:
        return 201, (await run_in_threadpool(make)).model_dump(mode="json")

    return await idempotent(request, who, create)


@router.get("", response_model=CollectionList)
def list_collections(request: Request) -> CollectionList:
    return CollectionList(collections=[_info(c) for c in manager(request).list(tenant(request))])


@router.get("/{name}", response_model=CollectionInfo)
def get_collection(name: str, request: Request) -> CollectionInfo:
    col = manager(request).get(tenant(request), name)
    return _info(col.config, col.stats())


@router.delete("/{name}", status_code=204)
def delete_collection(name: str, request: Request) -> Response:
    manager(request).delete(tenant(request), name)
    return Response(status_code=204)
