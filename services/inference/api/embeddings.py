"""/v1/embeddings (OpenAI's shape) and /v1/rerank (vLLM's and Jina's shape): thin routes over
``services.inference.embeddings.EmbeddingService``. Any key may use them; the models are shared."""

from __future__ import annotations

from fastapi import APIRouter

from services.inference.api.deps import EmbeddingsDep
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
        404: {"description": "no such embedding or rerank model"},
        503: {"description": "the server is starting, or the model could not be loaded"},
    },
)


@router.post("/v1/embeddings", response_model=EmbeddingResponse, response_model_exclude_none=True)
async def create_embeddings(body: EmbeddingRequest, service: EmbeddingsDep) -> EmbeddingResponse:
    return await service.embeddings(body)


# vLLM serves the same route under these three paths; clients use each of them.
@router.post("/v1/rerank", response_model=RerankResponse, response_model_exclude_none=True)
@router.post("/v2/rerank", response_model=RerankResponse, response_model_exclude_none=True)
@router.post("/rerank", response_model=RerankResponse, response_model_exclude_none=True)
async def rerank(body: RerankRequest, service: EmbeddingsDep) -> RerankResponse:
    return await service.rerank(body)


@router.get("/v1/embeddings/tokenizer/{model:path}", response_model=EmbeddingTokenizer)
async def embedding_tokenizer(model: str, service: EmbeddingsDep) -> EmbeddingTokenizer:
    """Tandem extension: the model's tokenizer and sizes, so a remote embedder (the retrieval
    service with TANDEM_RETRIEVAL_EMBEDDER_URL) chunks text by the model's own tokens."""
    return await service.tokenizer(model)
