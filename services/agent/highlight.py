"""Highlighting the passage of a chunk that matches a query (for semantic search results)."""

from __future__ import annotations

import html
import math
from typing import TypedDict

from services.agent.chunks import Chunk
from services.common.text import WORD_RE, content_terms, overlap, sentences, stem, term_spans


def _sentence_score(
    terms: list[str], text: str, spans: list[tuple[int, int]], span: tuple[int, int]
) -> float:
    """Query words in the sentence, each weighted by how rare it is among the chunk's sentences
    (IDF with the chunk as the corpus): in "How tall is the Eiffel Tower?" against a chunk about the
    tower, "tall" picks the sentence, since "Eiffel" and "Tower" are in most of them."""
    words = [{stem(m.group(0)) for m in WORD_RE.finditer(text[s:e])} for s, e in spans]
    mine = {stem(m.group(0)) for m in WORD_RE.finditer(text[span[0] : span[1]])}
    n = len(spans)
    score = 0.0
    for term in terms:
        if term in mine:
            df = sum(1 for w in words if term in w)
            score += math.log(1 + n / df)
    return score


class Passage(TypedDict):
    text: str
    start: int
    end: int
    score: float


class Span(TypedDict):
    start: int
    end: int


class Highlight(TypedDict):
    """What a search result gains from the highlight node; offsets are the document's."""

    passage: Passage
    highlights: list[Span]
    highlighted: str


def highlight(query: str, chunk: Chunk, tag: str = "mark") -> Highlight:
    """The best-matching sentence of ``chunk`` plus the query words in it.

    Offsets are in the *document* (the chunk's ``start`` added), like the chunk's own
    ``start``/``end``, so a client can highlight the original document directly.
    ``highlighted`` is the chunk text, HTML-escaped, with the passage and words marked.
    """
    terms = content_terms(query)
    spans = sentences(chunk.text) or [(0, len(chunk.text))]
    best = max(spans, key=lambda s: (_sentence_score(terms, chunk.text, spans, s), -s[0]))
    words = term_spans(chunk.text, set(terms))
    pieces: list[str] = []
    pos = 0
    for s, e in words:
        pieces.append(html.escape(chunk.text[pos:s]))
        pieces.append(f"<{tag}>{html.escape(chunk.text[s:e])}</{tag}>")
        pos = e
    pieces.append(html.escape(chunk.text[pos:]))
    return {
        "passage": {
            "text": chunk.text[best[0] : best[1]],
            "start": chunk.start + best[0],
            "end": chunk.start + best[1],
            "score": round(overlap(terms, chunk.text[best[0] : best[1]]), 4),
        },
        "highlights": [{"start": chunk.start + s, "end": chunk.start + e} for s, e in words],
        "highlighted": "".join(pieces),
    }
