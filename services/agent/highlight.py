"""Highlighting the passage of a chunk that matches a query (for semantic search results)."""

from __future__ import annotations

import html
from typing import Any

from services.agent.chunks import Chunk
from services.agent.text import content_terms, overlap, sentences, term_spans


def highlight(query: str, chunk: Chunk, tag: str = "mark") -> dict[str, Any]:
    """The best-matching sentence of ``chunk`` plus the query words in it.

    Offsets are in the *document* (the chunk's ``start`` added), like the chunk's own
    ``start``/``end``, so a client can highlight the original document directly.
    ``highlighted`` is the chunk text, HTML-escaped, with the passage and words marked.
    """
    terms = content_terms(query)
    spans = sentences(chunk.text) or [(0, len(chunk.text))]
    best = max(spans, key=lambda s: (overlap(terms, chunk.text[s[0] : s[1]]), -s[0]))
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
