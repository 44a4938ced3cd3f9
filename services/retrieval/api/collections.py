"""``/v1/collections``: create, list, show, delete."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from services.retrieval.api.deps import manager, tenant
from services.retrieval.core.collection import CollectionConfig
from services.retrieval.protocol import Chunking, CollectionInfo, CollectionList, CreateCollection

router = APIRouter(prefix="/v1/collections", tags=["collections"])


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


@router.post("", status_code=201, response_model=CollectionInfo)
def create_collection(body: CreateCollection, request: Request) -> CollectionInfo:
    config = manager(request).create(
        tenant(request),
        body.name,
        embedding_model=body.embedding_model,
        chunk_size=body.chunking.size if body.chunking else None,
        chunk_overlap=body.chunking.overlap if body.chunking else None,
        index=body.index,
    )
    return _info(config, {"documents": 0, "chunks": 0})


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
