"""A search's hits as a reader reads them: each hit's candidate answer sentences
(services/common/candidates.py) and the heading path they are read under, scored by the cosine
of their embeddings to the query's, with the collection's own embedder in one batch. The agent's
answer step takes these scores instead of sending the same sentences back to be embedded."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.common.candidates import answer_candidates, context_of
from services.common.collection_embed import EMBED_TEXTS
from services.retrieval.core.embedder import Embedder
from services.retrieval.protocol import ScoredSentence, SearchResult


@dataclass(frozen=True)
class HitPassage:
    """What a reader reads of a hit: its section when the search returned one, else its text."""

    text: str
    start: int
    section: str
    title: str
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, hit: SearchResult) -> HitPassage:
        if hit.section_text and hit.section_text_start is not None:
            return cls(hit.section_text, hit.section_text_start, hit.section, hit.title, hit.metadata)
        return cls(hit.text, hit.start, hit.section, hit.title, hit.metadata)


def with_sentences(query: str, hits: list[SearchResult], embedder: Embedder) -> list[SearchResult]:
    """``hits`` with their scored sentences and context, as far as one batch of the embedder's
    texts (the query, the sentences, the distinct contexts) stays within ``EMBED_TEXTS``: a hit
    past that keeps ``sentences`` None and a reader embeds its sentences itself."""
    texts = [query]
    place: dict[str, int] = {}  # a context's place in ``texts`` (hits of one section share it)
    read: list[tuple[SearchResult, list[tuple[int, str, int]], str]] = []
    for hit in hits:
        passage = HitPassage.of(hit)
        found = answer_candidates([passage])
        context = context_of(passage)
        if len(texts) + len(found) + 1 > EMBED_TEXTS:
            break
        sentences = [(c.position, c.text, len(texts) + i) for i, c in enumerate(found)]
        texts += [c.text for c in found]
        if context and context not in place:
            place[context] = len(texts)
            texts.append(context)
        read.append((hit, sentences, context))
    if len(texts) == 1:
        return hits
    vectors = np.asarray(embedder.embed_documents(texts), dtype=np.float32)
    cosines = vectors @ vectors[0]
    for hit, sentences, context in read:
        hit.sentences = [
            ScoredSentence(position=pos, text=text, score=float(cosines[i])) for pos, text, i in sentences
        ]
        hit.context = context or None
        hit.context_score = float(cosines[place[context]]) if context else None
    return hits
