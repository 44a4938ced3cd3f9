"""The reader's scorers: how well each candidate sentence answers a question, and whether any does.

``AnswerScorer`` is the answer step's one seam. ``ReaderScorer``, the default, is a reader
trained by the trainer's ``reader`` jobs (the default ``tandem-reader``: the collections'
embedder tuned on the tuning question sets' candidate sentences; a tenant's, trained further on
its feedback) and served by the inference service's ``/v1/rerank``: it reads the question beside
each sentence under its section's heading path and orders them; whether any answers is the
rules' verdict, or a threshold on its score where one is set. ``features.FeatureScorer`` answers
while no reader is served, and ``services/agent/reader/rules.py`` holds the last fallback: the
collection's embedder and lexical rules.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from services.agent.chunks import Chunk
from services.agent.reader.question import Asked
from services.common.candidates import Candidate
from services.common.errors import NotFound
from services.common.readers import reader_passage

# (model, question, passages) -> one score per passage, in order (inference's /v1/rerank).
Rerank = Callable[[str, str, list[str]], Awaitable[list[float]]]


@dataclass
class Scored:
    """A scorer's verdict on the candidates: ``scores`` one per candidate (higher answers better),
    ``answers`` whether each answers the question on its own."""

    scores: list[float]
    answers: list[bool]
    scorer: str  # which scorer judged: "reader:<model>" or "rules"
    # A second answering sentence of the best one's section joins it when it scores within this
    # of the best (in the scorer's own units).
    margin: float = 0.0
    # Names of the question no source holds: then nothing answers (the rules' check).
    missing: list[str] | None = None


class AnswerScorer(Protocol):
    """Scores ``candidates`` for the question: ``read`` hands it the question parsed
    (``question.Asked``); a caller that holds only its text may pass that, parsed at the top."""

    name: str

    async def score(
        self, question: str | Asked, chunks: list[Chunk], candidates: list[Candidate]
    ) -> Scored: ...


class ReaderScorer:
    """A served reader (a cross-encoder, or a bi-encoder answering cosines): one ``/v1/rerank``
    call per question. A sentence answers when it scores at least ``threshold``; without one,
    the reader only orders the candidates and whether any answers is ``verdict``'s (the rules')
    say, as ``features.FeatureScorer`` does: measured on the held-out sets, one threshold on a
    reader's score says "not found" to far more answerable questions than the rules do."""

    def __init__(
        self,
        model: str,
        threshold: float | None,
        rerank: Rerank,
        *,
        verdict: AnswerScorer | None = None,
        margin: float = 0.05,
        max_candidates: int = 256,
        on_missing: Callable[[], None] | None = None,
    ) -> None:
        if threshold is None and verdict is None:
            raise ValueError("a reader without a threshold needs a verdict scorer")
        self.verdict = verdict
        self.model = model
        self.threshold = threshold
        self.margin = margin
        self.rerank = rerank
        # the inference service's per-request cap on documents; the candidates are in source
        # order, and the sources are ranked, so what falls past it is the least likely
        self.max_candidates = max_candidates
        self.name = f"reader:{model}"
        # told when the inference service does not serve ``model`` (its 404)
        self.on_missing = on_missing

    async def score(self, question: str | Asked, chunks: list[Chunk], candidates: list[Candidate]) -> Scored:
        kept = candidates[: self.max_candidates]
        passages = [reader_passage(c.text, c.context) for c in kept]
        # the model reads the question as written: no rule of this package reads it
        text = question.text if isinstance(question, Asked) else question
        try:
            scores = await self.rerank(self.model, text, passages) if passages else []
        except NotFound:
            if self.on_missing is not None:
                self.on_missing()
            raise
        if len(scores) != len(kept):
            raise ValueError(f"the reader returned {len(scores)} scores for {len(kept)} sentences")
        scores = [float(s) for s in scores] + [float("-inf")] * (len(candidates) - len(kept))
        if self.threshold is not None:
            return Scored(scores, [s >= self.threshold for s in scores], self.name, self.margin)
        assert self.verdict is not None
        judged = await self.verdict.score(question, chunks, candidates)
        found = any(judged.answers)
        return Scored(scores, [found] * len(scores), self.name, self.margin, judged.missing)
