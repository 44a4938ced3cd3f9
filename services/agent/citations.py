"""Citation markers ``[n]`` in answers, resolved against the chunks the prompt numbered.

Resolution happens on the server: an answer's ``[2]`` becomes the chunk id,
document id, title and character offsets of the second chunk shown to the
model. A number that names no chunk is counted as invalid, never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from services.agent.chunks import Chunk, Citation
from services.agent.locate import claim_before
from services.common.text import content_terms, overlap, sentences

# "[1]", "[1, 3]", "[1][2]", "[Source 2]", "[source: 2]"
MARKER_RE = re.compile(r"\[\s*(?:sources?\s*:?\s*)?(\d{1,3}(?:\s*[,;]\s*\d{1,3})*)\s*\]", re.IGNORECASE)
# Small models also cite a source by its title: "[Jupiter]". Resolved only on an exact title match.
TITLE_MARKER_RE = re.compile(r"\[\s*([^\[\]\d\s][^\[\]]{0,119}?)\s*\]")
# Longest tail that may still grow into a marker: held back (from citation events only) while streaming.
_OPEN_TAIL_RE = re.compile(r"\[[^\[\]]{0,120}$")


def _title_key(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).removeprefix("the ").strip()


def marker_numbers(text: str) -> list[int]:
    """Every number cited in ``text``, in order of first appearance."""
    seen: dict[int, None] = {}
    for match in MARKER_RE.finditer(text):
        for part in re.split(r"[,;]", match.group(1)):
            seen.setdefault(int(part.strip()), None)
    return list(seen)


@dataclass
class CitationTracker:
    """Resolves markers as tokens stream in, so each citation is sent as soon as it is complete."""

    chunks: list[Chunk]
    text: str = ""
    resolved: dict[int, Citation] = field(default_factory=dict)
    invalid: list[int] = field(default_factory=list)
    by_title: int = 0  # markers that named a source by its title ("[Jupiter]")
    _scanned: int = 0

    def feed(self, delta: str) -> list[Citation]:
        """Add streamed text; return citations completed by it."""
        self.text += delta
        return self._scan(final=False)

    def finish(self) -> list[Citation]:
        return self._scan(final=True)

    def _scan(self, final: bool) -> list[Citation]:
        end = len(self.text)
        if not final:
            tail = _OPEN_TAIL_RE.search(self.text)
            if tail:
                end = tail.start()
        new: list[Citation] = []
        titles = {_title_key(c.title): i + 1 for i, c in reversed(list(enumerate(self.chunks))) if c.title}
        found = [
            (m.start(), m.end(), m.group(1), True) for m in MARKER_RE.finditer(self.text, self._scanned, end)
        ]
        found += [
            (m.start(), m.end(), m.group(1), False)
            for m in TITLE_MARKER_RE.finditer(self.text, self._scanned, end)
        ]
        for begin, stop, body, numeric in sorted(found):
            if numeric:
                numbers = [int(part.strip()) for part in re.split(r"[,;]", body)]
            elif _title_key(body) in titles:
                numbers = [titles[_title_key(body)]]
                self.by_title += 1
            else:
                numbers = []
            for n in numbers:
                if n in self.resolved or n in self.invalid:
                    continue
                if 1 <= n <= len(self.chunks):
                    claim = claim_before(self.text, begin)
                    self.resolved[n] = Citation.of(n, self.chunks[n - 1], claim=claim)
                    new.append(self.resolved[n])
                else:
                    self.invalid.append(n)
            self._scanned = max(self._scanned, stop)
        return new

    @property
    def citations(self) -> list[Citation]:
        return [self.resolved[n] for n in sorted(self.resolved)]


def attribute(
    answer: str, chunks: list[Chunk], min_overlap: float = 0.5, max_citations: int = 3
) -> list[Citation]:
    """For an answer without markers: the chunks its sentences are drawn from, if they share enough.

    Judged sentence by sentence, not over the whole answer: a small model that repeats
    itself or adds a sentence of its own would otherwise dilute a clear match below the
    threshold. Marked ``kind="attributed"`` so it is never mistaken for a citation the
    model made.
    """
    if not chunks:
        return []
    whole = content_terms(answer)
    pieces = [answer[s:e] for s, e in sentences(answer)] or [answer]
    picked: list[int] = []
    claims: dict[int, str] = {}
    for piece in [answer, *pieces]:
        terms = content_terms(piece)
        # Very short sentences ("Yes.") say nothing about where they came from.
        if len(terms) < min(3, len(whole)) or not terms:
            continue
        best, idx = max((overlap(terms, c.text), i) for i, c in enumerate(chunks))
        if best >= min_overlap and idx not in picked:
            picked.append(idx)
            claims[idx] = piece
        if len(picked) >= max_citations:
            break
    return [Citation.of(idx + 1, chunks[idx], kind="attributed", claim=claims[idx]) for idx in picked]
