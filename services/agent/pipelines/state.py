"""What flows through a pipeline run: the state components read and write, and their context."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, get_args

from services.agent.chunks import Chunk, Citation
from services.agent.citations import CitationTracker
from services.agent.clients import InferenceClient, RetrievalClient
from services.agent.config import AgentSettings
from services.agent.events import AnswerKind, Event
from services.agent.prompting import PromptPlan
from services.agent.protocol import Message, Sampling, wire_messages
from services.agent.reader.select import Selection
from services.agent.reader.unserved import UnservedReaders
from services.agent.tokens import TokenCounter
from services.common.jsonsafe import JsonObject
from services.common.openai_wire import ToolCall, ToolCallDelta

__all__ = [
    "AnswerFields",
    "AnswerForm",
    "AnswerKind",
    "Event",
    "EventStream",
    "RunContext",
    "RunState",
    "Slot",
    "Sockets",
    "StateView",
    "TurnOptions",
]

EventStream = AsyncIterator[Event]


@dataclass
class RunContext:
    """Per-request services: clients carry the caller's own key."""

    settings: AgentSettings
    retrieval: RetrievalClient
    inference: InferenceClient
    counter: TokenCounter
    model: str
    # The caller chose ``model`` (``llm``, or the conversation's remembered one): its answer is
    # wanted, so an extracting answer step leaves the answer to it.
    chosen: bool = False
    # The tenant's promoted reader and its threshold (None: the agent's reader settings): the
    # answer step's reader when the pipeline names none.
    reader: str | None = None
    reader_threshold: float | None = None
    # The readers the inference service answered 404 for lately (the agent's one table; None:
    # every answer asks).
    unserved: UnservedReaders | None = None
    # The caller's key, which that table is kept by.
    api_key: str = ""


class TurnOptions(TypedDict, total=False):
    """What a turn asks of the pipeline's steps beyond its question: the retriever's ``top_k``
    (a run request's), the generator's ``temperature`` (a regenerated draft's) and ``max_tokens``
    (the OpenAI facade's, at most the pipeline's own)."""

    top_k: int
    temperature: float
    max_tokens: int


class AnswerFields(TypedDict, total=False):
    """The caller's answer-form fields of an inference request, those given only."""

    tools: list[JsonObject]
    tool_choice: str | JsonObject
    parallel_tool_calls: bool
    response_format: JsonObject


class StateView(TypedDict):
    """A run's state as foreign components (LangChain runnables) read it."""

    question: str
    collection: str | None
    history: list[dict[str, Any]]
    search_query: str
    chunks: list[dict[str, Any]]
    answer: str


@dataclass
class AnswerForm:
    """What a caller asked of the answer's form beyond text (the OpenAI facade): ``tools``,
    ``tool_choice``, ``parallel_tool_calls`` and ``response_format``, sent to the inference service
    as given (it validates them and constrains the output), and the assistant tool calls and tool
    results that follow the question, sent after the prompt the pipeline builds."""

    tools: list[JsonObject] | None = None
    tool_choice: str | JsonObject | None = None
    parallel_tool_calls: bool | None = None
    response_format: JsonObject | None = None
    tail: list[Message] = field(default_factory=list)

    def body(self) -> AnswerFields:
        """The fields of the inference request, those given only."""
        fields = AnswerFields()
        if self.tools is not None:
            fields["tools"] = self.tools
        if self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        if self.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = self.parallel_tool_calls
        if self.response_format is not None:
            fields["response_format"] = self.response_format
        return fields

    @property
    def json_answer(self) -> bool:
        """The answer is JSON: response_format json_object / json_schema, or a call that
        ``tool_choice`` forces ("required" or a named function; cut short by max_tokens, the
        inference returns the call's JSON as content)."""
        forced = bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, dict))
        return forced or (self.response_format or {}).get("type") in ("json_object", "json_schema")


# A run's inputs: the caller's, there from the start for every component to read.
Input = Literal["question", "collection", "history", "options", "form"]
# What components make of them: each node type declares the slots it needs, reads and writes
# (its sockets, ``Sockets``), so a definition whose component needs what no component it runs
# after writes is refused when it is built, and a component that writes a slot it does not
# declare fails its run instead of surprising a later one.
Slot = Literal[
    "search_query",
    "chunks",
    "results",
    "plan",
    "tracker",
    "no_context",
    "selection",
    "prompt",
    "model",
    "sampling",
    "answer",
    "answer_kind",
    "completion",
    "tool_calls",
    "usage",
    "finish_reason",
    "citations",
    "invalid_citations",
    "grounding",
    "groundedness",
    "unsupported",
]
INPUTS: frozenset[str] = frozenset(get_args(Input))
SLOTS: tuple[Slot, ...] = get_args(Slot)


@dataclass(frozen=True)
class Sockets:
    """What a component does with the run state beyond the inputs (which it may always read):
    ``needs`` must have been written by a component it runs after (else the definition is
    refused), ``reads`` are read when an earlier component wrote them, ``writes`` are the only
    slots its run may change."""

    needs: frozenset[Slot] = frozenset()
    reads: frozenset[Slot] = frozenset()
    writes: frozenset[Slot] = frozenset()

    @classmethod
    def of(
        cls, needs: tuple[Slot, ...] = (), reads: tuple[Slot, ...] = (), writes: tuple[Slot, ...] = ()
    ) -> Sockets:
        return cls(frozenset(needs), frozenset(needs) | frozenset(reads), frozenset(writes))


class UndeclaredWrite(RuntimeError):
    """A component changed a slot its sockets do not name: a bug in that component."""


def _held(value: object) -> object:
    """What a slot holds, for telling whether a run changed it: the object itself, and for a
    list or dict its members' identities (an append changes it; a member's own fields do not)."""
    if isinstance(value, list):
        return (id(value), tuple(id(v) for v in value))
    if isinstance(value, dict):
        return (id(value), tuple((k, id(v)) for k, v in value.items()))
    return (id(value), value)


@dataclass
class RunState:
    question: str
    collection: str | None
    history: list[Message] = field(default_factory=list)
    options: TurnOptions = field(default_factory=TurnOptions)
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
    prompt: list[Message] | None = None
    model: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    # The model's own text (``answer`` is what is shown: the groundedness guard may replace it).
    completion: str = ""
    # "extractive" when the guard answered from the sources, "not_found" when none answers.
    answer_kind: AnswerKind = "generated"
    # The answer step's choice of source sentences (None: the pipeline has no answer_selector).
    selection: Selection | None = None
    grounding: str | None = None  # the guard's verdict (services/agent/grounding.py)
    groundedness: float | None = None
    unsupported: list[dict[str, Any]] = field(default_factory=list)
    # The caller's tools / response_format (None: a text answer, the pipeline's own way).
    form: AnswerForm | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)  # what the model called, in order

    @property
    def structured(self) -> bool:
        """A JSON answer (response_format) or tool calls: what rewrites answer text (citation
        markers, the repetition cut, the groundedness guard) must leave it alone."""
        return bool(self.tool_calls) or (self.form is not None and self.form.json_answer)

    def add_tool_delta(self, delta: ToolCallDelta) -> None:
        """One streamed piece of a call: the first names it, the next add to its arguments."""
        while len(self.tool_calls) <= delta.index:
            self.tool_calls.append(ToolCall())
        call = self.tool_calls[delta.index]
        call.id = delta.id or call.id
        if delta.function is not None:
            call.function.name = delta.function.name or call.function.name
            call.function.arguments += delta.function.arguments or ""

    def held(self) -> dict[Slot, object]:
        """Each slot's value as ``changed`` compares it."""
        return {slot: _held(getattr(self, slot)) for slot in SLOTS}

    def changed(self, before: dict[Slot, object]) -> set[Slot]:
        """The slots whose value differs from ``before`` (``held()`` taken earlier)."""
        now = self.held()
        return {slot for slot in SLOTS if now[slot] != before[slot]}

    def view(self) -> StateView:
        """A plain-dict view for foreign components (LangChain runnables)."""
        return {
            "question": self.question,
            "collection": self.collection,
            "history": wire_messages(self.history),
            "search_query": self.search_query or self.question,
            "chunks": [c.to_result() for c in self.chunks],
            "answer": self.answer,
        }
