"""Wire models of /v1/embeddings (OpenAI's shape, plus vLLM's ``truncate_prompt_tokens``) and
/v1/rerank (the shape vLLM and Jina use)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from services.common.bounds import NAME_CHARS, Name, Text

# OpenAI's limit on inputs per embeddings request; a rerank's documents as Cohere's.
MAX_INPUTS = 2048
MAX_DOCUMENTS = 1000
MAX_INPUT_TOKENS = 1 << 20
MAX_DIMENSIONS = 65536

_TokenIds = Annotated[
    list[Annotated[int, Field(strict=True, ge=0, le=(1 << 31) - 1)]], Field(max_length=MAX_INPUT_TOKENS)
]


class _Open(BaseModel):
    # Clients send fields we do not use (user, ...): accepted and ignored, as on chat.
    model_config = ConfigDict(extra="allow")


class EmbeddingRequest(_Open):
    model: str = Field(..., min_length=1, max_length=NAME_CHARS)
    # Strings, or token ids of the embedding model's own tokenizer (their range is checked in the
    # serving layer, against the model's vocabulary).
    input: (
        Text
        | Annotated[list[Text], Field(max_length=MAX_INPUTS)]
        | _TokenIds
        | Annotated[list[_TokenIds], Field(max_length=MAX_INPUTS)]
    ) = Field(..., description=f"At most {MAX_INPUTS} inputs.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1, le=MAX_DIMENSIONS)
    user: Name | None = None
    truncate_prompt_tokens: StrictInt | None = Field(
        None,
        ge=-1,
        le=MAX_INPUT_TOKENS,
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
    model: str = Field(..., min_length=1, max_length=NAME_CHARS)
    query: Text = Field(..., min_length=1)
    documents: list[Text] = Field(..., min_length=1, max_length=MAX_DOCUMENTS)
    top_n: StrictInt | None = Field(
        None, ge=0, le=MAX_DOCUMENTS, description="Best results returned; none or 0: all."
    )
    return_documents: StrictBool = True
    truncate_prompt_tokens: StrictInt | None = Field(
        None,
        ge=-1,
        le=MAX_INPUT_TOKENS,
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
