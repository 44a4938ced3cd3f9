"""``POST /v1/collections/{name}/embed``'s shapes: texts embedded by the retrieval service with a
collection's own embedder, which it holds in process. The agent's reader compares a question
with its candidate sentences this way (services/agent/clients.py), with no model lookup and no
second service."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# A reader's texts of one question (the question, its candidate sentences, their headings).
EMBED_TEXTS = 2048
EMBED_TEXT_CHARS = 8192


class EmbedRequest(BaseModel):
    """Texts to embed with the embedder the collection searches with."""

    model_config = ConfigDict(extra="forbid")
    input: list[Annotated[str, Field(max_length=EMBED_TEXT_CHARS)]] = Field(
        ..., min_length=1, max_length=EMBED_TEXTS
    )


class EmbedResponse(BaseModel):
    model: str  # the embedder the collection searches with now (its own, or the one it switched to)
    vectors: list[list[float]]  # one per text, in order, L2-normalised
