"""Answer quality on live traffic: the signals of each chat answer, and their metrics.

A chat answer's :class:`AnswerQuality` is read off what the pipeline already worked out while
answering (the groundedness guard's share of supported sentences, the citations shown, the
answer's kind), so measuring costs no model or embedder call. It is stored on the turn record;
the user's thumbs join it when feedback arrives. The same signals are Prometheus metrics,
labelled by tenant, pipeline and model, on the agent's ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from services.agent.events import AnswerKind
from services.agent.protocol import AnswerQuality

# Citation kinds that are a [n] marker in the shown answer; "attributed" (the answer had no
# marker, the source it overlaps most was named for it), "see_also" and "source" are not.
CITING_KINDS = frozenset({"cited", "extractive"})

BUCKET_SECONDS = {"hour": 3600, "day": 86400, "week": 7 * 86400}

GROUNDEDNESS_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0)


def cites(citations: Iterable[dict[str, Any]]) -> bool:
    return any(c.get("kind", "cited") in CITING_KINDS for c in citations)


def answer_quality(
    *, groundedness: float | None, citations: Iterable[dict[str, Any]], answer_kind: AnswerKind, model: str
) -> AnswerQuality:
    return AnswerQuality(
        groundedness=None if groundedness is None else min(1.0, max(0.0, float(groundedness))),
        cited=cites(citations),
        answer_kind=answer_kind,
        model=model,
        rating=None,
    )


class QualityMetrics:
    """The quality counters of one agent app (registered on its ``/metrics`` registry)."""

    def __init__(self) -> None:
        labels = ["tenant", "pipeline", "model"]
        self.answers = Counter(
            "tandem_agent_answers_total",
            "Chat answers by kind (generated, extractive, not_found)",
            [*labels, "answer_kind"],
            registry=None,
        )
        self.cited = Counter(
            "tandem_agent_answers_cited_total",
            "Chat answers whose text cites a source with a [n] marker",
            labels,
            registry=None,
        )
        self.groundedness = Histogram(
            "tandem_agent_answer_groundedness",
            "Share of an answer's sentences a source supports (answers the groundedness guard judged)",
            labels,
            buckets=GROUNDEDNESS_BUCKETS,
            registry=None,
        )
        self.ratings = Counter(
            "tandem_agent_answer_ratings_total",
            "Thumbs given on chat answers (each rating given or changed counts once)",
            [*labels, "rating"],
            registry=None,
        )

    def register(self, registry: CollectorRegistry) -> None:
        for collector in (self.answers, self.cited, self.groundedness, self.ratings):
            registry.register(collector)

    def observe_answer(self, tenant: str, pipeline: str, quality: AnswerQuality) -> None:
        labels = (tenant, pipeline, quality.model)
        self.answers.labels(*labels, quality.answer_kind).inc()
        if quality.cited:
            self.cited.labels(*labels).inc()
        if quality.groundedness is not None:
            self.groundedness.labels(*labels).observe(quality.groundedness)

    def observe_rating(self, tenant: str, pipeline: str, model: str, rating: int) -> None:
        self.ratings.labels(tenant, pipeline, model, "up" if rating > 0 else "down").inc()
