"""``POST /v1/collections/{name}/search``."""

from __future__ import annotations

import time

from fastapi import APIRouter

from services.common.errors import InvalidRequest
from services.retrieval.api.deps import CollectionDep
from services.retrieval.protocol import SearchRequest, SearchResponse

router = APIRouter(
    prefix="/v1/collections", tags=["search"], responses={404: {"description": "no such collection"}}
)


@router.post("/{name}/search", response_model=SearchResponse)
def search(body: SearchRequest, col: CollectionDep) -> SearchResponse:
    t0 = time.perf_counter()
    if not body.query.strip():
        raise InvalidRequest(
            f"query must not be empty (got {body.query!r})", param="query", code="empty_query"
        )
    hits = col.search(
        body.query,
        top_k=body.top_k,
        mode=body.mode,
        filters=body.filters,
        rerank=body.rerank,
        weights={str(k): v for k, v in body.weights.items()} if body.weights else None,
    )
    return SearchResponse(
        results=hits,
        mode=body.mode,
        took_ms=round((time.perf_counter() - t0) * 1000, 3),
    )
