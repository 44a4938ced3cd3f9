"""/v1/embeddings (OpenAI's shape) and /v1/rerank (vLLM's and Jina's shape): thin routes over
``services.inference.embeddings.EmbeddingService``. Any key may use them; the configured models are
shared, and ``/v1/rerank`` also serves the caller tenant's published readers (and the shared ones)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from services.inference.api.deps import EmbeddingsDep, ReaderScopeDep
from services.inference.protocol_embeddings import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingTokenizer,
    RerankRequest,
    RerankResponse,
)

router = APIRouter(
    tags=["embeddings"],
    responses={
        404: {"description": "no such embedding or rerank model (or reader of the caller's)"},
        503: {"description": "the server is starting, or the model could not be loaded"},
    },
)


@router.post("/v1/embeddings", response_model=EmbeddingResponse, response_model_exclude_none=True)
async def create_embeddings(body: EmbeddingRequest, service: EmbeddingsDep) -> EmbeddingResponse:
    return await service.embeddings(body)


# vLLM serves the same route under these three paths; clients use each of them.
# an operator may act for a tenant (X-Tandem-Tenant) to use that tenant's readers
ACTING: dict[int | str, dict[str, Any]] = {
    403: {"description": "X-Tandem-Tenant sent with a key that is not an operator's"}
}


@router.post("/v1/rerank", response_model=RerankResponse, response_model_exclude_none=True, responses=ACTING)
@router.post("/v2/rerank", response_model=RerankResponse, response_model_exclude_none=True, responses=ACTING)
@router.post("/rerank", response_model=RerankResponse, response_model_exclude_none=True, responses=ACTING)
async def rerank(body: RerankRequest, service: EmbeddingsDep, readers: ReaderScopeDep) -> RerankResponse:
    """Scores ``documents`` for ``query``: with a configured rerank model, or a published reader
    (``ft-reader-...``) of the caller's tenant or a shared one (documents built with
    ``services.common.readers.reader_passage``)."""
    return await service.rerank(body, readers)


@router.get("/v1/embeddings/tokenizer/{model:path}", response_model=EmbeddingTokenizer)
async def embedding_tokenizer(model: str, service: EmbeddingsDep) -> EmbeddingTokenizer:
    """Tandem extension: the model's tokenizer and sizes, so a remote embedder (the retrieval
    service with TANDEM_RETRIEVAL_EMBEDDER_URL) chunks text by the model's own tokens."""
    return await service.tokenizer(model)
