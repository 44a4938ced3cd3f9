"""Which sentence of a cited chunk a citation points at, and where that is in the document.

A citation names a chunk; a person checking it wants the one sentence of it that supports the
claim. ``cited_sentence`` picks the chunk sentence sharing most content words with the claim
(the answer's sentence the marker closes), headings and code fences aside; with no claim (or no
word in common) it is the chunk's first sentence. Offsets are in the document's text.
"""

from __future__ import annotations

import bisect
import re

from services.common.text import content_terms, overlap, sentences

# The answer text a marker closes: back to the previous sentence end (markers themselves dropped).
_MARKERS_RE = re.compile(r"\[[^\[\]]{0,120}\]")
_SENTENCE_END_RE = re.compile(r"[.!?](?=\s)|\n")


def claim_before(answer: str, pos: int) -> str:
    """The sentence of ``answer`` that ends at ``pos`` (where a citation marker starts)."""
    head = _MARKERS_RE.sub(" ", answer[:pos]).rstrip()
    head = head.rstrip(".!?")
    ends = [m.end() for m in _SENTENCE_END_RE.finditer(head)]
    return " ".join(head[ends[-1] :].split() if ends else head.split())


def _candidates(text: str) -> list[tuple[int, int]]:
    spans = sentences(text)
    body = [(s, e) for s, e in spans if not text[s:e].lstrip().startswith(("#", "```", "~~~"))]
    return body or spans or [(0, len(text))]


def cited_sentence(chunk_text: str, chunk_start: int, claim: str | None) -> tuple[int, int]:
    """(start, end) in the document of the sentence of the chunk that ``claim`` draws on."""
    spans = _candidates(chunk_text)
    best = spans[0]
    terms = content_terms(claim) if claim else []
    if terms:
        score, neg_start = max((overlap(terms, chunk_text[s:e]), -s) for s, e in spans)
        if score > 0:
            best = next(sp for sp in spans if sp[0] == -neg_start)
    return chunk_start + best[0], chunk_start + best[1]


def page_at(pages: list[int], page_starts: list[int], offset: int) -> int | None:
    """The PDF page of the character at document offset ``offset`` in a chunk on ``pages``."""
    if not pages:
        return None
    if len(page_starts) != len(pages):
        return pages[0]
    return pages[max(bisect.bisect_right(page_starts, offset) - 1, 0)]
