"""What flows through a pipeline run: the state components read and write, and their context."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from services.agent.chunks import Chunk, Citation
from services.agent.citations import CitationTracker
from services.agent.clients import InferenceClient, RetrievalClient
from services.agent.config import AgentSettings
from services.agent.events import AnswerKind, Event
from services.agent.prompting import PromptPlan
from services.agent.tokens import TokenCounter

__all__ = ["AnswerKind", "Event", "EventStream", "RunContext", "RunState"]

EventStream = AsyncIterator[Event]


@dataclass
class RunContext:
    """Per-request services: clients carry the caller's own key."""

    settings: AgentSettings
    retrieval: RetrievalClient
    inference: InferenceClient
    counter: TokenCounter
    model: str


@dataclass
class RunState:
    question: str
    collection: str | None
    history: list[dict[str, str]] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    search_query: str = ""
    chunks: list[Chunk] = field(default_factory=list)
    plan: PromptPlan | None = None
    tracker: CitationTracker | None = None
    no_context: bool = False
    answer: str = ""
    citations: list[Citation] = field(default_factory=list)
    invalid_citations: list[int] = field(default_factory=list)
    results: list[dict[str, Any]] | None = None
    usage: dict[str, int] = field(default_factory=dict)
    finish_reason: str = "stop"
    # What the generator sent, exactly (the turn record keeps it): None when no model was called.
    prompt: list[dict[str, str]] | None = None
    model: str = ""
    sampling: dict[str, Any] = field(default_factory=dict)
    # The model's own text (``answer`` is what is shown: the groundedness guard may replace it).
    completion: str = ""
    answer_kind: AnswerKind = "generated"  # "extractive" when the guard answered from the sources
    grounding: str | None = None  # the guard's verdict (services/agent/grounding.py)
    groundedness: float | None = None
    unsupported: list[dict[str, Any]] = field(default_factory=list)

    def view(self) -> dict[str, Any]:
        """A plain-dict view for foreign components (LangChain runnables)."""
        return {
            "question": self.question,
            "collection": self.collection,
            "history": list(self.history),
            "search_query": self.search_query or self.question,
            "chunks": [c.to_result() for c in self.chunks],
            "answer": self.answer,
        }
