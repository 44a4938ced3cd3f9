"""Wire models of the agent service."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from services.agent.chunks import ChunkCitation, Citation
from services.agent.evals.protocol import MetricDifference, RegressionReport
from services.agent.events import AnswerKind
from services.common.bounds import (
    JSON_SCHEMA,
    JSON_SMALL,
    MAX_UNIX_S,
    NAME_CHARS,
    JsonData,
    JsonSchema,
    JsonSmall,
    Name,
    Text,
)
from services.common.openai_wire import ChatDelta, FunctionCall, SparseModel, ToolCall, Usage, WireModel

# A request's limits (docs/contracts.md, "Request limits"), as the inference service's: a chat's
# messages and a message's parts, the tools offered, and answer tokens (a static ceiling; the
# agent's context window, context_tokens, is checked when the turn is read).
MAX_MESSAGES = 2048
MAX_PARTS = 2048
MAX_TOOLS = 128
MAX_TOKENS = 1 << 20
_COLLECTION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


def _llm_field() -> Any:
    return Field(
        None,
        min_length=1,
        max_length=256,
        description="Model that generates (a base model or one of the tenant's fine-tunes); "
        "default: the conversation's, else the service's.",
    )


def _history_call(call: ToolCall) -> ToolCall:
    """A call an assistant message made, as a caller sends it back in the history: OpenAI's
    shape with an id, a function name of 1-64 characters and type ``function``; only those
    fields are kept."""
    if not call.id:
        raise ValueError("a tool call needs its id")
    if call.type != "function":
        raise ValueError(f"a tool call's type must be 'function', got {call.type!r}")
    if not 1 <= len(call.function.name) <= 64:
        raise ValueError(f"a tool call's function name must be 1-64 characters, got {call.function.name!r}")
    if "arguments" not in call.function.model_fields_set:
        raise ValueError("a tool call's function needs its arguments (JSON text)")
    return ToolCall(
        id=call.id, function=FunctionCall(name=call.function.name, arguments=call.function.arguments)
    )


class Message(BaseModel):
    """A chat message: as a caller sends it, and as a pipeline's history and prompt carry it."""

    model_config = ConfigDict(extra="ignore")

    # "developer": OpenAI's newer name for system (the facade leaves both out of the prompt)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[JsonData], Field(max_length=MAX_PARTS)] | None = None
    name: Name | None = None
    tool_calls: list[Annotated[ToolCall, AfterValidator(_history_call)]] | None = Field(
        default=None, max_length=MAX_PARTS, description="assistant: the calls it made"
    )
    tool_call_id: Name | None = Field(default=None, description="tool: the call this is the result of")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content if isinstance(p, dict))
        return self.content or ""


def wire_messages(messages: Iterable[Message]) -> list[dict[str, Any]]:
    """OpenAI's JSON of ``messages``, as sent to the model and stored: unset fields left out."""
    return [m.model_dump(exclude_none=True) for m in messages]


class PipelineRunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: Text | None = Field(None, description="The question or search query (alias: message).")
    message: Text | None = None
    collection: str | None = Field(None, max_length=64, pattern=_COLLECTION_PATTERN)
    conversation_id: Name | None = None
    remember: StrictBool = Field(False, description="Keep the exchange in a (new) conversation.")
    history: list[Message] | None = Field(None, max_length=MAX_MESSAGES)
    top_k: StrictInt | None = Field(None, ge=1, le=100)
    stream: StrictBool = False
    llm: str | None = _llm_field()
    mcp_servers: list[Name] | None = Field(
        None, max_length=20, description="Registered MCP servers whose tools join the agent's (agents only)."
    )

    def question(self) -> str:
        return self.query if self.query is not None else (self.message or "")


class ChatCompletionRequest(BaseModel):
    """OpenAI's request, with ``collection`` (and ``conversation_id``) as extra fields."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(max_length=NAME_CHARS)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    collection: str | None = Field(None, max_length=64, pattern=_COLLECTION_PATTERN)
    conversation_id: Name | None = None
    llm: str | None = _llm_field()
    stream: StrictBool = False
    stream_options: JsonSmall | None = None
    user: Name | None = None
    # Passed to the pipeline's generation step as sent; the inference service validates them
    # (its 400 names the field). Agents refuse them.
    tools: list[JsonSchema] | None = Field(None, max_length=MAX_TOOLS)
    # none, auto, required or a named function: checked by the inference
    tool_choice: Annotated[Any, JSON_SCHEMA] = None
    parallel_tool_calls: StrictBool | None = None
    response_format: JsonSchema | None = None
    max_tokens: StrictInt | None = Field(
        None,
        ge=1,
        le=MAX_TOKENS,
        description="At most the pipeline's own answer budget; beyond the context window a 400.",
    )
    max_completion_tokens: StrictInt | None = Field(
        None, ge=1, le=MAX_TOKENS, description="max_tokens' newer name."
    )
    mcp_servers: list[Name] | None = Field(
        None, max_length=20, description="Registered MCP servers whose tools join the agent's (agents only)."
    )


# -- the facade's answers: OpenAI's envelope, with the turn's citations and ids beside it -----------


class OpenAIModel(BaseModel):
    """A pipeline or agent, as ``/v1/models`` lists it (``kind``: ``pipeline:<kind>`` or ``agent``)."""

    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "tandem"
    kind: str


class OpenAIModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIModel]


# A chat pipeline's answer cites by resolved markers (Citation), a search's by its numbered
# results (ChunkCitation); each is written with its own fields.
AnswerCitation = Citation | ChunkCitation


class CompletionMessage(SparseModel):
    """The answer: ``content`` is null when it is only tool calls; ``tool_calls`` only when made."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    _omit_unset = frozenset({"tool_calls"})


class CompletionChoice(WireModel):
    index: int = 0
    message: CompletionMessage
    finish_reason: str


class ChatCompletion(SparseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    citations: list[AnswerCitation]
    # "generated", "extractive" or "not_found" (a chat pipeline's text answer; absent otherwise).
    answer_kind: AnswerKind | None = None
    message_id: str
    conversation_id: str | None
    _omit_unset = frozenset({"answer_kind"})


class ChunkChoice(WireModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None


class ChatCompletionChunk(SparseModel):
    """A piece of a streamed answer. The last (``finish_reason`` set) alone carries the turn's
    citations and ids, its ``answer_kind`` (chat pipelines; ``kind`` too when a groundedness guard
    ran), and ``usage`` when
    ``stream_options.include_usage`` asked for it."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    citations: list[AnswerCitation] | None = None
    message_id: str | None = None
    conversation_id: str | None = None
    kind: AnswerKind | None = None
    answer_kind: AnswerKind | None = None
    usage: Usage | None = None
    _omit_unset = frozenset({"citations", "message_id", "conversation_id", "kind", "answer_kind", "usage"})


class StreamErrorDetail(BaseModel):
    message: str
    code: str | None


class StreamError(BaseModel):
    """An error after the stream began (its status was already 200): a data event of its own."""

    error: StreamErrorDetail


class WsChatFrame(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["chat", "stop"] = "chat"
    pipeline: Name | None = None
    agent: Name | None = None
    collection: str | None = Field(None, max_length=64, pattern=_COLLECTION_PATTERN)
    conversation_id: Name | None = None
    message: Text | None = None
    llm: str | None = _llm_field()


MESSAGE_ID_PATTERN = r"^msg_[0-9a-f]{24}$"


# -- turn records and feedback (issue 13) ---------------------------------------------------------


class AnswerQuality(BaseModel):
    """Quality signals of one chat answer, computed as it is produced (the guard's own figures,
    nothing judged again) and kept on its turn record; ``rating`` follows the feedback."""

    groundedness: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="share of the shown answer's sentences a source supports (the groundedness "
        "guard's figure; 1.0 for an extractive answer); null when the guard did not run",
    )
    cited: bool = Field(description="the shown answer cites a source with a [n] marker")
    answer_kind: AnswerKind
    model: str = Field(description="the model that answered (empty when none was called)")
    rating: Literal[1, -1] | None = Field(None, description="the user's thumbs: 1 up, -1 down, null none")


class Sampling(SparseModel):
    """What a chat request to the inference service asks beyond its model and messages, as it
    was sent (a turn record keeps it): the fields given, and only those, are in the JSON
    (``None`` included when given). The agent's own are named; a pipeline's further sampling
    parameters (``GenerateNode``'s ``sampling``) pass as given, for the inference service to
    validate."""

    model_config = ConfigDict(extra="allow")

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # a caller's as it came: the inference service checks it (a 400 naming it)
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    _omit_unset = frozenset(
        {
            "max_tokens",
            "temperature",
            "top_p",
            "stop",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "response_format",
        }
    )


class TurnRecord(BaseModel):
    """One assistant turn as it was produced: the exact prompt the model saw and what it said."""

    message_id: str
    conversation_id: str | None = None
    pipeline: str
    collection: str | None = None
    model: str
    sampling: Sampling = Field(default_factory=Sampling)
    prompt: list[dict[str, Any]] = Field(default_factory=list)
    chunk_ids: list[str] = Field(default_factory=list)
    completion: str = ""
    citations: list[dict[str, Any]] = Field(default_factory=list)
    # The calls the model made instead of (or beside) ``completion``, when the caller offered tools.
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    created_at: float
    draft_of: str | None = None
    # Beyond the contract: what the user asked and saw, and what regenerating needs.
    question: str = ""
    answer: str = ""
    kind: Literal["pipeline", "agent"] = "pipeline"
    finish_reason: str = "stop"
    # "extractive" when the groundedness guard showed source sentences instead of ``completion``.
    answer_kind: AnswerKind = "generated"
    # Chat answers (not searches, agents, JSON answers or tool calls): services/agent/quality.py.
    quality: AnswerQuality | None = None
    sources: list[dict[str, Any]] = Field(default_factory=list, exclude=True)
    tenant: str = Field(default="", exclude=True)
    user: str = Field(default="", exclude=True)


class FeedbackCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message_id: str = Field(min_length=1, max_length=64)
    rating: Literal[1, -1]
    correction: Text | None = None
    comment: str | None = Field(None, max_length=4000)


class Feedback(BaseModel):
    message_id: str
    rating: int
    correction: str | None = None
    comment: str | None = None
    pipeline: str
    model: str
    collection: str | None = None
    question: str
    answer: str
    conversation_id: str | None = None
    draft_of: str | None = None
    created_at: float
    updated_at: float
    key_id: str | None = Field(default=None, description="the key that gave the feedback")
    counted: bool | None = Field(
        default=None,
        description="(when given) whether it is among the key's first feedback_rows_per_key ratings and "
        "choices, the ones a training set counts; later ones are stored but not counted",
    )


class FeedbackList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Feedback]
    total: int
    has_more: bool


class ModelStats(BaseModel):
    model: str
    up: int = 0
    down: int = 0
    corrections: int = 0
    preferences: int = 0


class FeedbackStats(BaseModel):
    data: list[ModelStats]


QualityBucketName = Literal["hour", "day", "week"]


class QualityPoint(BaseModel):
    """One model's answers in one time bucket (``start``: unix seconds, UTC-aligned)."""

    model: str
    start: float
    answers: int
    groundedness_mean: float | None = Field(description="over the answers the guard judged; null if none")
    judged: int = Field(description="answers with a groundedness")
    cited_share: float
    extractive_share: float
    not_found_share: float
    rated: int = Field(description="answers with a thumbs up or down")
    thumbs_up_rate: float | None = Field(description="up / rated; null when none is rated")


class QualityReport(BaseModel):
    object: Literal["quality"] = "quality"
    bucket: QualityBucketName
    since: float
    data: list[QualityPoint]


class WorstAnswer(BaseModel):
    message_id: str
    conversation_id: str | None = None
    pipeline: str
    model: str
    collection: str | None = None
    created_at: float
    question: str
    answer: str
    groundedness: float | None = None
    cited: bool
    answer_kind: AnswerKind
    rating: Literal[1, -1] | None = None


class WorstAnswers(BaseModel):
    object: Literal["list"] = "list"
    since: float
    data: list[WorstAnswer]


class RegenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stream: StrictBool = False


class ApprovalDecision(BaseModel):
    """POST /v1/agents/approvals/{id}: run the held tool call (``approve: true``) or refuse it."""

    model_config = ConfigDict(extra="forbid")

    approve: StrictBool
    stream: StrictBool = Field(False, description="The continued run as SSE events instead of JSON.")


class ChooseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    over: str = Field(min_length=1, max_length=64, description="the other draft, the one not chosen")


class Choice(BaseModel):
    chosen: str
    rejected: str


# pairs: (question, cited chunk) rows of thumbs-up answers, for an embedder job (issue 17)
DatasetFormat = Literal["kto", "dpo", "sft", "pairs"]


class DatasetRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: DatasetFormat
    since: StrictFloat | None = Field(
        None, ge=0, le=MAX_UNIX_S, description="only feedback given at or after (unix seconds)"
    )
    pipeline: Name | None = None
    model: Name | None = None
    exclude_keys: list[Name] = Field(
        default_factory=list,
        max_length=1000,
        description="key ids whose feedback is left out (GET /v1/feedback/contributors lists them)",
    )


class TrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: DatasetFormat | Literal["auto"] = Field(
        default="auto",
        description="auto: kto where thumbs up are at least as many as corrections, dpo where "
        "corrections outnumber them (measured: benchmarks/RESULTS.md, the loop)",
    )
    since: StrictFloat | None = Field(None, ge=0, le=MAX_UNIX_S)
    pipeline: Name | None = None
    model: Name | None = None
    eval_fraction: StrictFloat | None = Field(None, gt=0, le=0.5)
    hyperparameters: Annotated[dict[str, float | int | str | bool], JSON_SMALL] | None = Field(
        None, description="passed to the trainer's job as is (it checks them); empty: the job type's defaults"
    )
    exclude_keys: list[Name] = Field(
        default_factory=list,
        max_length=1000,
        description="key ids whose feedback is left out (GET /v1/feedback/contributors lists them)",
    )


class LeftOut(BaseModel):
    """One contributor's feedback a training set does not count, and why."""

    contributor: str = Field(description="a user's id (a person: all of its tokens together) or a key's id")
    kind: Literal["user", "key"]
    reason: Literal["over_cap", "excluded"] = Field(
        description="over_cap: past the per-user cap (feedback_rows_per_key), the first ones counted; "
        "excluded: named in exclude_keys"
    )
    ratings_and_choices: int | None = Field(
        default=None, description="how many were left out (null for excluded: all of them)"
    )
    detail: str = Field(description="the reason in words")


class DatasetResult(BaseModel):
    file_id: str
    format: DatasetFormat
    rows: int
    counts: dict[str, int]
    contributors: dict[str, int] = Field(default_factory=dict, description="rows per key that gave them")
    per_key_cap: int | None = Field(
        default=None, description="ratings and choices counted per user (or per key that is no user's)"
    )
    over_cap: dict[str, int] = Field(
        default_factory=dict, description="per key: ratings and choices past the cap, stored but not counted"
    )
    excluded_keys: list[str] = Field(default_factory=list, description="keys whose feedback was left out")
    left_out: list[LeftOut] = Field(
        default_factory=list, description="whose feedback the set does not count, how much and why"
    )
    collections: list[str] = Field(
        default_factory=list,
        description="the collections the rows' answers came from: a fine-tune trained on them is served "
        "only to people who may read them all, unless an admin allows it (POST /v1/models/{id}/allow)",
    )


class Contributor(BaseModel):
    """One key's feedback in its tenant."""

    key_id: str
    name: str | None = Field(default=None, description="the key's label (null: the key no longer exists)")
    ratings: int
    corrections: int
    preferences: int
    counted: int = Field(description="ratings and choices a training set of all the feedback counts")
    last_at: float


class ContributorList(BaseModel):
    object: Literal["list"] = "list"
    per_key_cap: int
    data: list[Contributor]


class ReaderTraining(BaseModel):
    """The reader's part of "train on feedback": a reader job on the feedback about extractive
    answers, or why none started."""

    started: bool
    reason: str = Field(default="", description="why no reader job started")
    file_id: str | None = None
    rows: int = 0
    counts: dict[str, int] = Field(default_factory=dict)
    job: dict[str, Any] | None = None
    promotion: Promotion | None = None


class TrainResult(BaseModel):
    dataset: DatasetResult
    job: dict[str, Any]
    promotion: Promotion | None = Field(
        default=None,
        description="the gate that evaluates the fine-tune when it is trained (GET /v1/promotions)",
    )
    reader: ReaderTraining | None = Field(
        default=None, description="the reader job on the same feedback (extractive answers' rows)"
    )


# -- the tenant's chat model and fine-tunes promoted to it ------------------------------------------

PromotionStatus = Literal["training", "evaluating", "promoted", "kept", "failed"]


class ReaderChoice(BaseModel):
    """A reader the answer step scores sentences with, and the score at which a sentence answers."""

    name: str = Field(description="a published reader (ft-reader-...); '' is the agent's reader setting")
    threshold: float | None = Field(
        default=None, description="from the reader's held-out rows; null: the agent's reader_threshold"
    )


class ModelChoice(BaseModel):
    """The model a tenant's chat pipelines answer with when the turn and its conversation name
    none, and the reader their answer step uses when the pipeline names none."""

    default: str | None = Field(
        default=None, description="the promoted model; null: the service's base model"
    )
    previous: list[str] = Field(
        default_factory=list,
        description="earlier defaults, newest last ('' is the base model): rollback's path",
    )
    canary: str | None = Field(
        default=None, description="a candidate answering a share of the tenant's chats"
    )
    canary_share: float = Field(default=0.0, ge=0.0, le=1.0)
    canary_since: float | None = None
    reader: ReaderChoice | None = Field(
        default=None, description="the promoted reader; null: the agent's reader setting"
    )
    previous_readers: list[ReaderChoice] = Field(
        default_factory=list, description="earlier readers, newest last (name '': the agent's setting)"
    )
    updated_at: float | None = None


class PromoteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    canary_share: StrictFloat | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="between 0 and 1: the model answers that share of the tenant's chats (a canary) and "
        "the default stays; 1 or left out: the model becomes the default; 0: the canary stops",
    )


class GateScores(BaseModel):
    """One model's answers on one evaluation set (shares of the set; null where nothing was measured)."""

    answered: int
    matches: float | None = Field(default=None, description="answers holding the reference's content words")
    grounded: float | None = Field(default=None, description="mean share of sentences a source supports")
    cited: float | None = Field(default=None, description="answers citing a source with a [n] marker")


class GateSet(BaseModel):
    name: Literal["regression", "recent", "adversarial"] = Field(
        description="adversarial: the regression questions reworded to mislead (services/agent/promotions.py)"
    )
    questions: int
    candidate: GateScores
    current: GateScores
    worse: list[str] = Field(
        default_factory=list,
        description="metrics the candidate loses by more than the margin and at least twice the "
        "loss's standard error: these keep it",
    )
    too_few: list[str] = Field(
        default_factory=list,
        description="metrics it loses by more than the margin but within 2 SE: too few questions to "
        "tell from chance (they do not keep it)",
    )
    metrics: dict[str, MetricDifference] = Field(
        default_factory=dict,
        description="per metric over the questions both answered: a (the current model's), b (the "
        "candidate's), their difference, its paired se, enough (|difference| >= 2 se) and "
        "questions_needed (when not enough: how many would tell a difference this size)",
    )


class ModelAllowance(BaseModel):
    """An admin's decision to serve a fine-tune to the whole tenant, whatever collections its
    feedback came from."""

    by: str = Field(description="the id of the admin's user or key")
    at: float = Field(description="unix seconds")
    reason: str = ""


class AllowRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field("", max_length=1000, description="why (kept in the audit log)")


class Promotion(BaseModel):
    """A fine-tune from feedback and the gate's verdict on it."""

    job_id: str
    kind: Literal["model", "reader"] = Field(
        default="model", description="a chat model (LoRA adapter) or the answer step's reader"
    )
    candidate: str | None = Field(default=None, description="the published model, once the job has trained")
    replaces: str = Field(
        default="", description="the tenant's default when training started ('' is the base model)"
    )
    status: PromotionStatus
    reason: str = ""
    margin: float
    holdout: list[str] = Field(default_factory=list, description="message ids held out as the regression set")
    sets: list[GateSet] = Field(default_factory=list)
    regression_sets: RegressionReport | None = Field(
        default=None,
        description="the tenant's evaluation sets marked regression, answered first by the "
        "candidate and the current one (no sets: it says so)",
    )
    created_at: float
    decided_at: float | None = None
    collections: list[str] = Field(
        default_factory=list,
        description="the collections its training rows came from: the fine-tune is served to a person "
        "only if that person may read them all (admins read all), unless 'allowed' says otherwise",
    )
    left_out: list[LeftOut] = Field(
        default_factory=list, description="feedback its training set did not count, and why"
    )
    allowed: ModelAllowance | None = Field(
        default=None, description="an admin's decision to serve it to everyone in the tenant"
    )


class LiveQuality(BaseModel):
    """A model's answers on the tenant's live chats since the canary started."""

    model: str
    answers: int
    groundedness_mean: float | None
    cited_share: float
    thumbs_up_rate: float | None


class PromotionList(BaseModel):
    object: Literal["list"] = "list"
    choice: ModelChoice
    live: list[LiveQuality] = Field(default_factory=list, description="while a canary runs")
    data: list[Promotion]


class WsFeedbackFrame(FeedbackCreate):
    type: Literal["feedback"]


class WsRegenerateFrame(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["regenerate"]
    message_id: str = Field(min_length=1, max_length=64)


class WsChooseFrame(ChooseRequest):
    type: Literal["choose"]
    message_id: str = Field(min_length=1, max_length=64)


# -- people and their tokens (/v1/users, services/common/users.py) ----------------------------

UserRole = Literal["admin", "member", "viewer"]
GroupName = Annotated[str, Field(min_length=1, max_length=64)]


class UserCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    email: str = Field(
        min_length=3, max_length=254, description="unique in the tenant (compared in lower case)"
    )
    role: UserRole = "member"
    groups: list[GroupName] = Field(default_factory=list, max_length=64)


class UserUpdate(BaseModel):
    """Only the fields given change."""

    model_config = ConfigDict(extra="forbid")

    email: str | None = Field(None, min_length=3, max_length=254)
    role: UserRole | None = None
    groups: list[GroupName] | None = Field(None, max_length=64)


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("", max_length=128, description="a label to recognise the token by")
    expires_at: StrictFloat | None = Field(
        None, ge=0, le=MAX_UNIX_S, description="unix seconds after which the token no longer works"
    )


class TokenCreated(BaseModel):
    id: str
    user_id: str
    name: str
    created_at: float
    expires_at: float | None = None
    token: str = Field(description="the token itself: shown this once, stored only as a hash")


class AuthConfig(BaseModel):
    """How the web front end may sign in (GET /v1/auth/config, public)."""

    oidc: bool = Field(description="whether sign-in with the organisation's OpenID provider is set up")
    name: str = Field("", description="the provider's name, for the sign-in button")
    login_url: str | None = Field(
        None, description="where the button leads (GET, a redirect to the provider)"
    )


class SessionInfo(BaseModel):
    """Who the request is signed in as (GET /v1/auth/session)."""

    tenant: str
    role: str = Field(description="operator, admin, member or viewer")
    user_id: str | None = Field(None, description="the signed-in person (null for an API key)")
    email: str | None = None
    groups: list[str] = Field(default_factory=list)
    via: str = Field(description="cookie (a web sign-in) or bearer (a key or token in the header)")
    csrf: str | None = Field(
        None, description="send as X-CSRF-Token on writes signed in by the cookie (null for bearer)"
    )
    expires_at: float | None = Field(None, description="when the web sign-in ends (unix seconds)")
