"""Wire models of /v1/embeddings (OpenAI's shape, plus vLLM's ``truncate_prompt_tokens``) and
/v1/rerank (the shape vLLM and Jina use)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Open(BaseModel):
    # Clients send fields we do not use (user, ...): accepted and ignored, as on chat.
    model_config = ConfigDict(extra="allow")


class EmbeddingRequest(_Open):
    model: str = Field(..., min_length=1)
    # Strings, or token ids of the embedding model's own tokenizer (their range is checked in the
    # serving layer, against the model's vocabulary).
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(
        None,
        ge=-1,
        description="vLLM extension: cut each input to this many tokens (-1: the model's limit) "
        "instead of refusing a longer one.",
    )

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        # One clear sentence instead of pydantic's error per union branch; and no lax coercion
        # (true is not token 1, "3" is not token 3).
        def token(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if isinstance(value, str):
            return value
        if isinstance(value, list) and (
            all(isinstance(x, str) for x in value)
            or all(token(x) for x in value)
            or all(isinstance(x, list) and all(token(t) for t in x) for x in value)
        ):
            return value
        raise ValueError(
            "must be a string, a list of strings, a token array (a list of integers) or a list of token arrays"
        )


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    # base64: the little-endian float32 bytes, as OpenAI sends them.
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class RerankRequest(_Open):
    model: str = Field(..., min_length=1)
    query: str = Field(..., min_length=1)
    documents: list[str] = Field(..., min_length=1)
    top_n: int | None = Field(None, ge=0, description="Best results returned; none or 0: all.")
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(
        None,
        ge=-1,
        description="Accepted for vLLM's shape; query-document pairs are always cut to the model's limit.",
    )


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    object: Literal["rerank"] = "rerank"
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class EmbeddingTokenizer(BaseModel):
    """Tandem extension: what a remote embedder (the retrieval service) needs to chunk text
    exactly as the model counts tokens."""

    model: str
    dimensions: int
    max_tokens: int
    tokenizer: str = Field(description="The model's Hugging Face fast tokenizer, as tokenizer.json text.")
