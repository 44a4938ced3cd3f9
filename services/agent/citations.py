"""Citation markers ``[n]`` in answers, resolved against the chunks the prompt numbered.

Resolution happens on the server: an answer's ``[2]`` becomes the chunk id,
document id, title and character offsets of the second chunk shown to the
model. A number that names no chunk is counted as invalid, never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from services.agent.chunks import Chunk, Citation
from services.agent.text import content_terms, overlap

# "[1]", "[1, 3]", "[1][2]", "[Source 2]", "[source: 2]"
MARKER_RE = re.compile(r"\[\s*(?:sources?\s*:?\s*)?(\d{1,3}(?:\s*[,;]\s*\d{1,3})*)\s*\]", re.IGNORECASE)
# Longest tail that may still grow into a marker: held back while streaming.
_OPEN_TAIL_RE = re.compile(r"\[[^\[\]]{0,20}$")


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
        for match in MARKER_RE.finditer(self.text, self._scanned, end):
            for part in re.split(r"[,;]", match.group(1)):
                n = int(part.strip())
                if n in self.resolved or n in self.invalid:
                    continue
                if 1 <= n <= len(self.chunks):
                    self.resolved[n] = Citation.of(n, self.chunks[n - 1])
                    new.append(self.resolved[n])
                else:
                    self.invalid.append(n)
            self._scanned = match.end()
        return new

    @property
    def citations(self) -> list[Citation]:
        return [self.resolved[n] for n in sorted(self.resolved)]


def attribute(answer: str, chunks: list[Chunk], min_overlap: float = 0.5) -> list[Citation]:
    """For an answer without markers: the chunk whose words the answer shares most, if it shares enough.

    Marked ``kind="attributed"`` so it is never mistaken for a citation the model made.
    """
    terms = content_terms(answer)
    if not terms or not chunks:
        return []
    scored = [(overlap(terms, c.text), i) for i, c in enumerate(chunks)]
    best, idx = max(scored)
    if best < min_overlap:
        return []
    return [Citation.of(idx + 1, chunks[idx], kind="attributed")]
