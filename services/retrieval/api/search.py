"""``POST /v1/collections/{name}/search`` and ``POST /v1/collections/{name}/embed`` (texts as the
collection's own embedder reads them: the model is in this process, so a reader comparing a
question with its candidate sentences needs no second service and no model lookup)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends
from opentelemetry import trace

from services.common.collection_embed import EmbedRequest, EmbedResponse
from services.common.errors import InvalidRequest
from services.retrieval.answer_sentences import with_sentences
from services.retrieval.api.deps import CollectionDep, check_access
from services.retrieval.metrics import QUERY_SECONDS
from services.retrieval.protocol import SearchRequest, SearchResponse

router = APIRouter(
    prefix="/v1/collections",
    tags=["search"],
    responses={404: {"description": "no such collection (or one the caller may not read)"}},
    dependencies=[Depends(check_access)],
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
    if body.section_tokens:
        hits = col.with_sections(hits, body.section_tokens)
    if body.sentences:
        hits = with_sentences(body.sentence_query or body.query, hits, col.embedder)
    took = time.perf_counter() - t0
    QUERY_SECONDS.labels(body.mode).observe(took)
    trace.get_current_span().set_attributes({"mode": body.mode, "top_k": body.top_k, "hits": len(hits)})
    return SearchResponse(results=hits, mode=body.mode, took_ms=round(took * 1000, 3))


@router.post(
    "/{name}/embed",
    response_model=EmbedResponse,
    responses={400: {"description": "a text too long, or too many or no texts (the field is named)"}},
)
def embed(body: EmbedRequest, col: CollectionDep) -> EmbedResponse:
    vectors = col.embedder.embed_documents(body.input)
    return EmbedResponse(model=col.embedder.name, vectors=vectors.tolist())
