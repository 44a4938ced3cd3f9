"""How close each of some texts is to a question: the cosine of their embeddings, by the
collection's own embedder. The scorers read similarities, not vectors, so they come either from
scores retrieval already computed for the hits' sentences (a search with ``sentences``) or from
one embedding call for what those lack."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import numpy as np

# Texts in, one vector per text out (retrieval's /embed with the collection's model).
Embed = Callable[[list[str]], Awaitable[list[list[float]]]]
# The question and texts in, the cosine of each text to the question out, in order.
Similarity = Callable[[str, list[str]], Awaitable[list[float]]]


def by_embedding(embed: Embed) -> Similarity:
    """Similarities from one call of ``embed`` on the question and the texts."""

    async def similarity(question: str, texts: list[str]) -> list[float]:
        if not texts:
            return []
        vectors = np.asarray(await embed([question, *texts]), dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != len(texts) + 1:
            raise ValueError(f"the embedder returned {vectors.shape[0]} vectors for {len(texts) + 1} texts")
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return [float(v) for v in vectors[1:] @ vectors[0]]

    return similarity


def with_known(scored: str, known: Mapping[str, float], fallback: Similarity | None) -> Similarity:
    """Similarities to ``scored`` read from ``known`` (text: cosine, as retrieval computed them);
    the texts it lacks, or any other question, go to ``fallback`` (none: an error, which a
    scorer's caller treats as the embedder failing)."""

    async def similarity(question: str, texts: list[str]) -> list[float]:
        table = dict(known) if question == scored else {}
        missing = list(dict.fromkeys(t for t in texts if t not in table))
        if missing:
            if fallback is None:
                raise ValueError(f"no similarity for {len(missing)} texts and no embedder to ask")
            table.update(zip(missing, await fallback(question, missing), strict=True))
        return [table[t] for t in texts]

    return similarity
