"""The events of one chat turn (contracts.md): one pydantic model per event type.

Every interface (websocket, SSE, the JSON and OpenAI answers) writes these out with
``wire()``: the event's ``type`` (and a step's ``kind``), then only the fields the producer
set, so an optional field that does not apply (``usage``, ``grounding``, ``draft_of``...) is
absent from the JSON rather than ``null``, exactly as when events were plain dicts.
``parse_event`` reads one back (a client, a test) through the discriminated union.

Events also answer dict-style reads (``event["text"]``, ``event.get("kind")``, ``event ==
{...}``) against their wire form, for code that reads them as the JSON a client gets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from services.agent.chunks import Citation

# "generated": the model's text; "extractive": source sentences the answer step chose; "not_found":
# no source sentence answers (the documents do not say; the closest sources are listed to see also).
AnswerKind = Literal["generated", "extractive", "not_found"]


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Always on the wire, even when left at their defaults: they say what the event is.
    _tags: ClassVar[tuple[str, ...]] = ("type",)

    def model_post_init(self, context: Any, /) -> None:
        self.__pydantic_fields_set__.update(self._tags)

    def wire(self) -> dict[str, Any]:
        """The event as it is sent: its tags and the fields that were set."""
        return self.model_dump(exclude_unset=True)

    def __getitem__(self, key: str) -> Any:
        return self.wire()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.wire().get(key, default)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Event):
            return self.wire() == other.wire()
        if isinstance(other, Mapping):
            return self.wire() == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class ConversationEvent(_Event):
    """The turn's conversation (sent first when it is remembered)."""

    type: Literal["conversation"] = "conversation"
    conversation_id: str | None


class TokenEvent(_Event):
    type: Literal["token"] = "token"
    text: str


class ToolCallDeltaEvent(_Event):
    """A streamed piece of a tool call the model made (only when the caller sent ``tools``, the
    OpenAI facade): the first piece of call ``index`` carries ``id`` and ``name``, the next ones
    argument text, as OpenAI's ``delta.tool_calls`` does."""

    type: Literal["tool_call_delta"] = "tool_call_delta"
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


class CitationEvent(_Event, Citation):
    """``[index]`` in the answer resolved to a chunk (``kind``: cited, attributed, extractive)."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    type: Literal["citation"] = "citation"

    @classmethod
    def from_citation(cls, citation: Citation) -> CitationEvent:
        return cls(**citation.to_dict())


class ResetEvent(_Event):
    """Clear what streamed so far: the groundedness guard's answer follows."""

    type: Literal["reset"] = "reset"
    reason: str


class _Step(_Event):
    _tags: ClassVar[tuple[str, ...]] = ("type", "kind")
    type: Literal["step"] = "step"


class ThoughtStep(_Step):
    kind: Literal["thought"] = "thought"
    step: int
    text: str
    error: str | None = None  # set when the step could not be parsed (a repair follows)


class ToolCallStep(_Step):
    kind: Literal["tool_call"] = "tool_call"
    step: int
    tool: str
    input: Any
    repairs: list[str] = Field(default_factory=list)


class ObservationStep(_Step):
    """A tool's result (``ok`` false: it failed or timed out, and the text says why)."""

    kind: Literal["observation"] = "observation"
    tool: str
    text: str
    ok: bool
    seconds: float | None = None


class FinalStep(_Step):
    kind: Literal["final"] = "final"
    text: str


class ToolLeftOut(BaseModel):
    """A tool an agent run was not offered, and why (agents/offering.py)."""

    model_config = ConfigDict(extra="forbid")

    tool: str
    reason: str
    server: str | None = None  # the MCP server the tool is of


class ToolsStep(_Step):
    """What an agent run is offered, the tools of the servers the request names first
    (``preferred``), and what it is not (``left_out``, each with why). Sent with the run's first
    step when a tool was left out or a server named; ``text`` says it in one line."""

    kind: Literal["tools"] = "tools"
    text: str
    offered: list[str]
    preferred: list[str] = Field(default_factory=list)
    left_out: list[ToolLeftOut] = Field(default_factory=list)


StepEvent = Annotated[
    ThoughtStep | ToolCallStep | ObservationStep | FinalStep | ToolsStep, Field(discriminator="kind")
]


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    message: str
    code: str | None = None
    status: int | None = None  # the HTTP status the error would have had (SSE only)
    param: str | None = None  # the field at fault (websocket quick writes only)
    retry_after: int | None = None  # seconds, with code rate_limit_exceeded (websocket)


class DoneEvent(_Event):
    """The last event of a turn: what a client keeps (ids, citations, why it ended)."""

    type: Literal["done"] = "done"
    conversation_id: str | None = None
    message_id: str | None = None
    draft_of: str | None = None  # regenerated drafts only
    model: str | None = None
    citations: list[dict[str, Any]] = Field(default_factory=list)
    finish_reason: str = "stop"
    usage: dict[str, int] = Field(default_factory=dict)
    results: list[dict[str, Any]] | None = None  # search pipelines only
    invalid_citations: list[int] = Field(default_factory=list)
    # What the answer is (chat pipelines): the model's, source sentences, or "not found".
    answer_kind: AnswerKind | None = None
    # The groundedness guard's outcome (pipelines with a guard only); ``kind`` is ``answer_kind``.
    kind: AnswerKind | None = None
    grounding: str | None = None
    unsupported: list[dict[str, Any]] = Field(default_factory=list)


class ApprovalRequiredEvent(_Event):
    """An agent run paused before a tool call with side effects (the agent's ``side_effects`` is
    ``approve``): ``POST /v1/agents/approvals/{approval_id}`` with ``{"approve": true}`` runs the
    turn again with this call allowed, ``false`` with it refused. Ends the turn's events."""

    type: Literal["approval_required"] = "approval_required"
    approval_id: str
    tool: str
    arguments: Any = None
    expires_at: float | None = None


class FeedbackAck(_Event):
    """Websocket: a ``feedback`` frame was recorded."""

    type: Literal["feedback"] = "feedback"
    message_id: str
    ok: bool = True


class ChoiceEvent(_Event):
    """Websocket: a ``choose`` frame was recorded."""

    type: Literal["choice"] = "choice"
    chosen: str
    rejected: str


# What a turn streams.
Event = (
    ConversationEvent
    | TokenEvent
    | ToolCallDeltaEvent
    | CitationEvent
    | ResetEvent
    | StepEvent
    | ErrorEvent
    | ApprovalRequiredEvent
    | DoneEvent
)
# What the websocket sends: a turn's events and the answers to quick writes.
WsEvent = Event | FeedbackAck | ChoiceEvent

_ADAPTER: TypeAdapter[WsEvent] = TypeAdapter(Annotated[WsEvent, Field(discriminator="type")])


def parse_event(data: Mapping[str, Any]) -> WsEvent:
    """An event from its wire form (the inverse of ``wire()``)."""
    return _ADAPTER.validate_python(dict(data))
