"""Wire models of evaluation sets and runs (``/v1/evals/...``).

A question is the line format ``tandem eval rag --questions`` reads (services/cli/eval_questions.py),
so a question file uploads as it is; ``id`` may be left out (the set numbers it). Every request
field is bounded: a set is at most ``MAX_QUESTIONS`` questions on the wire, and the agent's
``TANDEM_AGENT_EVAL_MAX_QUESTIONS`` (at most that) is the limit a set is held to (413 beyond it).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from services.common.jobs import JobStatus

# The hard ceiling of a set on the wire; the setting may only lower it.
MAX_QUESTIONS = 10_000
MAX_TEXT = 20_000  # a question or a reference answer, in characters
MAX_NAME = 200

QuestionKind = Literal["how", "why", "default", "yesno", "howmany", "when", "which", "what"]
# A key phrase, or a document name.
Phrase = Annotated[StrictStr, Field(min_length=1, max_length=1000)]


class EvalQuestion(BaseModel):
    """One question of a set: key phrases (``answers``, any one counts) or a ``reference``
    answer; the document that states it (``source``, and ``also_in``), its ``page`` or
    ``section``; ``answerable`` false for a question the documents do not answer."""

    model_config = ConfigDict(extra="forbid")

    id: StrictStr | None = Field(None, min_length=1, max_length=MAX_NAME)
    question: StrictStr = Field(min_length=1, max_length=MAX_TEXT)
    answers: list[Phrase] | None = Field(None, max_length=100)
    reference: StrictStr | None = Field(None, max_length=MAX_TEXT)
    source: StrictStr | None = Field(None, max_length=1000)
    also_in: list[Phrase] = Field(default_factory=list, max_length=50)
    page: StrictInt | None = Field(None, ge=1, le=1_000_000)
    section: StrictStr | None = Field(None, max_length=1000)
    answerable: StrictBool = True
    kind: QuestionKind | None = None
    paraphrased: StrictBool = False

    @model_validator(mode="after")
    def _consistent(self) -> EvalQuestion:
        if self.answers is not None and not [a for a in self.answers if a.strip()]:
            raise ValueError("answers: give at least one non-blank key phrase")
        if self.answerable:
            if not self.answers and not (self.reference or "").strip():
                raise ValueError("an answerable question needs answers (key phrases) or a reference")
        elif self.answers or self.reference or self.also_in:
            raise ValueError("an unanswerable question has no answers, reference or also_in")
        return self

    @property
    def sources(self) -> list[str]:
        return [s for s in [self.source, *self.also_in] if s and s.strip()]


class QuestionPatch(BaseModel):
    """Fields of one question to change (the result must still be a valid question)."""

    model_config = ConfigDict(extra="forbid")

    question: StrictStr | None = Field(None, min_length=1, max_length=MAX_TEXT)
    answers: list[Phrase] | None = Field(None, max_length=100)
    reference: StrictStr | None = Field(None, max_length=MAX_TEXT)
    source: StrictStr | None = Field(None, max_length=1000)
    also_in: list[Phrase] | None = Field(None, max_length=50)
    page: StrictInt | None = Field(None, ge=1, le=1_000_000)
    section: StrictStr | None = Field(None, max_length=1000)
    answerable: StrictBool | None = None
    kind: QuestionKind | None = None
    paraphrased: StrictBool | None = None


class EvalSetCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr = Field(min_length=1, max_length=MAX_NAME)
    collection: StrictStr = Field(min_length=1, max_length=MAX_NAME)
    questions: list[EvalQuestion] = Field(default_factory=list, max_length=MAX_QUESTIONS)
    regression: StrictBool = False


class EvalSetPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr | None = Field(None, min_length=1, max_length=MAX_NAME)
    collection: StrictStr | None = Field(None, min_length=1, max_length=MAX_NAME)
    regression: StrictBool | None = None


class FromMessage(BaseModel):
    """A chat answer as a question of the set: its question, the document it cited first as the
    source, and ``reference`` (the corrected answer; default: the correction, else the answer)."""

    model_config = ConfigDict(extra="forbid")

    message_id: StrictStr = Field(min_length=1, max_length=64)
    reference: StrictStr | None = Field(None, min_length=1, max_length=MAX_TEXT)


class QuestionsUpload(BaseModel):
    """``POST /v1/evals/sets/{id}/questions`` as JSON: one of ``jsonl`` (the question file's
    text), ``questions``, or ``from_message``; ``replace`` swaps the set's questions instead of
    adding to them."""

    model_config = ConfigDict(extra="forbid")

    jsonl: StrictStr | None = Field(None, max_length=16 << 20)
    questions: list[EvalQuestion] | None = Field(None, max_length=MAX_QUESTIONS)
    from_message: FromMessage | None = None
    replace: StrictBool = False

    @model_validator(mode="after")
    def _one(self) -> QuestionsUpload:
        given = [x for x in (self.jsonl, self.questions, self.from_message) if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of jsonl, questions or from_message")
        return self


class EvalSetSummary(BaseModel):
    id: str
    name: str
    collection: str
    regression: bool = False
    questions: int
    created_at: float
    updated_at: float


class EvalSet(BaseModel):
    id: str
    name: str
    collection: str
    regression: bool = False
    questions: list[EvalQuestion] = Field(default_factory=list)
    created_at: float
    updated_at: float

    def summary(self) -> EvalSetSummary:
        return EvalSetSummary(
            id=self.id,
            name=self.name,
            collection=self.collection,
            regression=self.regression,
            questions=len(self.questions),
            created_at=self.created_at,
            updated_at=self.updated_at,
        )


class EvalSetList(BaseModel):
    data: list[EvalSetSummary]


class EvalRunCreate(BaseModel):
    """``pipeline``: a chat pipeline (default ``chat-documents-generate``); ``llm``: the model
    that writes (default: the tenant's promoted default, else the served one); ``reader``: the
    answer step's reader (default: the tenant's); ``judge_model``: a model that also judges each
    answer against the reference; ``similarity``: also score answers against references with the
    collection's embedder."""

    model_config = ConfigDict(extra="forbid")

    set: StrictStr = Field(min_length=1, max_length=64)
    pipeline: StrictStr | None = Field(None, min_length=1, max_length=MAX_NAME)
    llm: StrictStr | None = Field(None, min_length=1, max_length=256)
    reader: StrictStr | None = Field(None, min_length=1, max_length=256)
    judge_model: StrictStr | None = Field(None, min_length=1, max_length=256)
    similarity: StrictBool = False


class Progress(BaseModel):
    done: int = 0
    total: int = 0


class JudgeVerdict(BaseModel):
    """A judge model's verdict on one answer, kept beside the automatic ones."""

    model: str
    verdict: Literal["correct", "incorrect", "unclear"]
    reason: str = ""


class EvalResult(BaseModel):
    """One question of a run, answered and judged. Flags are None where they do not apply (an
    unanswerable question is not "stated"; no source given, no source to cite)."""

    n: int  # 1-based position in the set
    id: str
    question: str
    kind: str | None = None
    answerable: bool
    answer: str = ""
    answer_kind: str = "generated"
    citations: list[dict[str, Any]] = Field(default_factory=list)
    stated: bool | None = None
    right_source: bool | None = None
    right_page: bool | None = None
    abstained: bool = False
    false_abstention: bool | None = None
    grounded: float | None = None
    overlap: float | None = None  # share of the reference's content words the answer holds
    similarity: float | None = None  # cosine of answer and reference (the collection's embedder)
    judge: JudgeVerdict | None = None
    latency_seconds: float = 0.0
    error: str | None = None

    @property
    def right(self) -> bool:
        """What a comparison calls a good answer: the expected one stated, or, for a question the
        documents do not answer, "not found"."""
        if self.error is not None:
            return False
        return bool(self.stated) if self.answerable else self.abstained


class Totals(BaseModel):
    """Shares are 0..1 over the questions each applies to (None: none did)."""

    questions: int = 0
    answerable: int = 0
    unanswerable: int = 0
    errors: int = 0
    stated: float | None = None
    right_source: float | None = None
    right_page: float | None = None
    not_found: float | None = None  # unanswerable questions answered "not found"
    false_not_found: float | None = None  # answerable questions answered "not found"
    grounded: float | None = None
    overlap: float | None = None
    similarity: float | None = None
    judged_correct: float | None = None
    p50_seconds: float | None = None
    p95_seconds: float | None = None


RunStatus = JobStatus


class EvalRunSummary(BaseModel):
    id: str
    set: str
    set_name: str = ""
    collection: str = ""
    pipeline: str
    llm: str | None = None
    reader: str | None = None
    judge_model: str | None = None
    status: RunStatus = "queued"
    progress: Progress = Field(default_factory=Progress)
    totals: Totals = Field(default_factory=Totals)
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None


class EvalRun(EvalRunSummary):
    totals_by_kind: dict[str, Totals] = Field(default_factory=dict)
    results: list[EvalResult] = Field(default_factory=list)
    # Heartbeat of the replica running it: a run not heard from in a while was interrupted.
    heartbeat_at: float | None = None

    def summary(self) -> EvalRunSummary:
        return EvalRunSummary.model_validate(self.model_dump(include=set(EvalRunSummary.model_fields)))


class EvalRunList(BaseModel):
    data: list[EvalRunSummary]


class MetricDifference(BaseModel):
    a: float | None
    b: float | None
    difference: float | None  # b - a
    se: float | None  # its standard error over the paired questions
    enough: bool = False  # |difference| >= 2 SE
    questions_needed: int | None = None  # when not enough: questions that would show it at ~2 SE


class ChangedQuestion(BaseModel):
    n: int
    id: str
    question: str
    a: EvalResult
    b: EvalResult


class RunComparison(BaseModel):
    a: str
    b: str
    questions: int  # paired questions (same id in both runs)
    fixed: list[ChangedQuestion]
    broken: list[ChangedQuestion]
    same: int
    totals: dict[str, MetricDifference]
    # For the headline metric, ``stated``: whether the difference is beyond ~2 SE.
    enough: bool
    questions_needed: int | None = None


class RegressionSetReport(BaseModel):
    """One regression set answered by a candidate and by what it would replace. ``totals``: per
    metric over the questions both answered, ``a`` the current one's, ``b`` the candidate's, their
    difference with its paired SE, ``enough`` and ``questions_needed`` (as in a comparison)."""

    set: str
    name: str
    questions: int
    candidate: Totals
    current: Totals
    totals: dict[str, MetricDifference] = Field(default_factory=dict)
    worse: list[str] = Field(
        default_factory=list, description="metrics lost by more than the margin and at least 2 SE"
    )
    too_few: list[str] = Field(
        default_factory=list,
        description="metrics lost by more than the margin but within 2 SE: too few questions to tell",
    )
    broken: list[ChangedQuestion] = Field(
        default_factory=list, description="questions the current one answers right and the candidate not"
    )
    fixed: int = 0


class RegressionReport(BaseModel):
    """``passed``: no metric of any regression set is worse (True, with no sets, when the tenant
    has no regression set: nothing says the candidate is worse)."""

    passed: bool
    reason: str
    sets: list[RegressionSetReport] = Field(default_factory=list)


# -- a reindex gated by the regression sets (POST /v1/collections/{name}/reindex) ----------------

# Retrieval's bounds on a reindex gate (services/retrieval/protocol.py ReindexGate, GateQuery).
MAX_GATE_QUERIES = 5000
MAX_RELEVANT = 100
MAX_GATE_QUERY = 4000


class GateQuery(BaseModel):
    """A held-out query and the ids of the collection's documents that answer it."""

    model_config = ConfigDict(extra="forbid")
    query: StrictStr = Field(min_length=1, max_length=MAX_GATE_QUERY)
    relevant: list[Annotated[StrictStr, Field(min_length=1, max_length=512)]] = Field(
        min_length=1, max_length=MAX_RELEVANT
    )


class ReindexRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    embedder: StrictStr = Field(min_length=1, max_length=256, description="as retrieval's PATCH takes it")
    min_gain: float | None = Field(None, strict=True, ge=0.0, le=1.0)
    mode: Literal["hybrid", "dense"] | None = None
    queries: list[GateQuery] = Field(
        default_factory=list, max_length=MAX_GATE_QUERIES, description="judged beside the regression sets'"
    )
    gate: StrictBool = Field(
        True, description="false: reindex without a gate, allowed only when there is nothing to gate with"
    )


class ReindexSet(BaseModel):
    """A regression set of the collection: ``queries``, its questions that became gate queries;
    ``unmatched``, answerable questions whose source names no document of the collection."""

    id: str
    name: str
    queries: int
    unmatched: int


class GatedReindex(BaseModel):
    """202: retrieval's reindex job, and what gates it."""

    job_id: str
    collection: str
    embedder: str
    index_version: int
    status_url: str
    events_url: str
    gated: bool
    regression_queries: int
    queries: int = Field(description="all the gate's queries: the regression sets' and the caller's")
    sets: list[ReindexSet]
