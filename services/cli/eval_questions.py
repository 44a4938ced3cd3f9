"""Question sets over real documents: the file format, and how one answer is judged.

A question set is a JSONL file, one ``Question`` per line (blank lines and lines starting
with ``#`` are skipped)::

    {"id": "fr-01", "question": "Which option makes Ferrule skip sockets?",
     "answers": ["--no-sockets"], "source": "manual.html",
     "section": "Choosing what to back up", "answerable": true, "kind": "which"}
    {"id": "fr-u1", "question": "How much memory does Ferrule need?", "answerable": false}

- ``answers``: key phrases, alternatives: the answer states the fact when it contains any one
  of them (case, spacing and ``_``/space ignored, whole words); or ``reference``: a reference
  answer, stated when the answer holds at least ``services.common.judge.REFERENCE_RECALL`` of its content words.
- ``source``: the document that states it: a path or file name (``docs/operations.md``,
  ``faq.html``), matched against a citation's document id, title and metadata source/filename
  with case, extension and separators ignored. ``also_in``: other documents of the set that state
  the same fact (a citation of any of them is a right source).
- ``page`` (1-based page of the PDF, as a viewer counts it) and ``section`` (a heading, or a
  distinctive part of one) where the fact is stated, when they are known.
- ``answerable``: false for a question the documents do not answer (no answers, no source):
  the right response is to abstain.
- ``kind`` (optional): what it asks for: ``how``, ``why``, ``default``, ``yesno``, ``howmany``,
  ``when``, ``which``, ``what``; ``paraphrased``: true when it is phrased in words the document
  does not use. Figures are also given per kind.

``load_questions`` names the line of a malformed entry. ``judge`` scores one answer with
services/agent/evals/judge.py (the evaluation API's judge, on services/common/judge.py) (from a
pipeline's ``done`` event or any other answerer) and ``summary`` adds them up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.agent.evals.jsonl import LineError, json_objects
from services.agent.evals.judge import answer_kind_of as judge_answer_kind
from services.agent.evals.judge import cites_right, percentile, source_matches
from services.agent.evals.judge import locates as judge_locates
from services.agent.evals.judge import states as judge_states
from services.common.judge import abstains, has_phrase

__all__ = ["abstains", "has_phrase", "percentile", "source_matches"]

# how-to, why, a default value, yes or no, a count, a time or condition, which one, what something is
QuestionKind = Literal["how", "why", "default", "yesno", "howmany", "when", "which", "what"]


class Question(BaseModel):
    """One line of a question set."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=200)
    question: str = Field(min_length=1)
    answers: list[str] | None = None
    reference: str | None = None
    source: str | None = None
    also_in: list[str] = Field(default_factory=list)
    page: int | None = Field(None, ge=1)
    section: str | None = None
    answerable: bool = True
    # What the question asks for, so figures can be read per kind of question.
    kind: QuestionKind | None = None
    # Phrased in words the document does not use (its key words paraphrased).
    paraphrased: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> Question:
        if self.answers is not None and not [a for a in self.answers if a.strip()]:
            raise ValueError("answers: give at least one non-blank key phrase")
        if self.answerable:
            if not self.answers and not (self.reference or "").strip():
                raise ValueError("an answerable question needs answers (key phrases) or a reference")
            if not (self.source or "").strip():
                raise ValueError("an answerable question needs the source that states it")
        elif self.answers or self.reference or self.also_in:
            raise ValueError("an unanswerable question has no answers, reference or also_in")
        return self

    @property
    def sources(self) -> list[str]:
        """The documents that state the answer: ``source``, then ``also_in``."""
        return [s for s in [self.source, *self.also_in] if s and s.strip()]

    def cited_by(self, cite: Mapping[str, Any]) -> bool:
        """Whether the citation names one of the documents that state the answer."""
        return any(source_matches(s, cite) for s in self.sources)


class QuestionSetError(ValueError):
    """A question set that cannot be read; ``line`` is 1-based (0: the file itself)."""

    def __init__(self, path: Path | str, line: int, message: str) -> None:
        where = f"{path} line {line}" if line else str(path)
        super().__init__(f"{where}: {message}")
        self.path = str(path)
        self.line = line


def parse_questions(lines: Iterable[str], path: Path | str = "<questions>") -> list[Question]:
    out: list[Question] = []
    seen: dict[str, int] = {}
    try:
        for n, data in json_objects(lines):
            try:
                q = Question.model_validate(data)
            except ValidationError as exc:
                err = exc.errors()[0]
                loc = ".".join(str(p) for p in err["loc"])
                raise QuestionSetError(path, n, f"{loc + ': ' if loc else ''}{err['msg']}") from None
            if q.id in seen:
                raise QuestionSetError(path, n, f"id {q.id!r} already used on line {seen[q.id]}")
            seen[q.id] = n
            out.append(q)
    except LineError as exc:
        raise QuestionSetError(path, exc.line, exc.message) from None
    if not out:
        raise QuestionSetError(path, 0, "no questions")
    return out


def load_questions(path: Path) -> list[Question]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise QuestionSetError(path, 0, f"cannot read it ({exc})") from None
    return parse_questions(text.splitlines(), path)


# -- judging (services/agent/evals/judge.py, which the evaluation API judges with too) ------


def states(answer: str, q: Question) -> bool:
    return judge_states(answer, q.answers, q.reference, q.question)


def locates(q: Question, cite: Mapping[str, Any]) -> bool | None:
    """The citation names the question's page or section: None when neither can be told (the
    question gives none, or the citation carries neither field)."""
    return judge_locates(q.page, q.section, cite)


@dataclass
class Outcome:
    """One answer to one question, judged."""

    id: str
    question: str
    answerable: bool
    answer: str
    answer_kind: str  # generated | extractive | not_found (from the response, else inferred)
    stated: bool | None  # answerable only: the expected answer is in the answer
    abstained: bool
    right_source: bool | None  # answerable only: a citation names the source (None: no citations)
    right_place: bool | None  # ... and the page or section (None: cannot be told)
    groundedness: float | None  # supported share of the answer's substantive sentences
    first_token_s: float | None
    total_s: float
    citations: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def answer_kind_of(done: Mapping[str, Any], answer: str) -> str:
    return judge_answer_kind(done.get("answer_kind") or done.get("kind"), answer)


def judge(
    q: Question,
    out: Mapping[str, Any],
    documents: list[str],
    *,
    cites_sources: bool = True,
) -> Outcome:
    """Scores one result of an answerer: ``out`` has ``answer``, ``done`` (the final event:
    ``citations``, ``answer_kind`` or ``kind``), ``first`` and ``total`` seconds, ``error``.
    ``documents``: the texts groundedness is judged against. ``cites_sources`` false: the
    answerer cites nothing (its citation metrics are None, not 0)."""
    from services.agent.grounding import check

    done: Mapping[str, Any] = out.get("done") or {}
    answer = str(out.get("answer") or "")
    cites = [dict(c) for c in done.get("citations") or [] if isinstance(c, Mapping)]
    kind = answer_kind_of(done, answer)
    abstained = kind == "not_found" or (kind != "extractive" and abstains(answer))
    right_source: bool | None = None
    right_place: bool | None = None
    if q.answerable and q.source and cites_sources:
        right_source, right_place = cites_right(q.sources, q.page, q.section, cites)
    report = check(answer, q.question, documents) if answer.strip() and not abstained else None
    return Outcome(
        id=q.id,
        question=q.question,
        answerable=q.answerable,
        answer=answer,
        answer_kind=kind,
        stated=states(answer, q) if q.answerable else None,
        abstained=abstained,
        right_source=right_source,
        right_place=right_place,
        groundedness=report.share if report else None,
        first_token_s=out.get("first"),
        total_s=float(out.get("total") or 0.0),
        citations=[
            {k: c.get(k) for k in ("document_id", "title", "page", "section", "kind") if k in c}
            for c in cites
        ],
        error=str(out["error"]) if out.get("error") else None,
    )


def _share(flags: list[bool | None]) -> float | None:
    judged = [f for f in flags if f is not None]
    return sum(judged) / len(judged) if judged else None


def summary(outcomes: list[Outcome]) -> dict[str, Any]:
    ok = [o for o in outcomes if o.error is None]
    yes = [o for o in ok if o.answerable]
    no = [o for o in ok if not o.answerable]
    grounded = [o.groundedness for o in ok if o.groundedness is not None]
    firsts = [o.first_token_s for o in ok if o.first_token_s is not None]
    totals = [o.total_s for o in ok]
    kinds = [o.answer_kind for o in ok]
    return {
        "questions": len(outcomes),
        "answerable": sum(1 for o in outcomes if o.answerable),
        "unanswerable": sum(1 for o in outcomes if not o.answerable),
        "errors": len(outcomes) - len(ok),
        "answer_stated": _share([o.stated for o in yes]),
        "right_source_cited": _share([o.right_source for o in yes]),
        "right_page_or_section_cited": _share([o.right_place for o in yes]),
        "abstained_when_unanswerable": _share([o.abstained for o in no]),
        "false_abstention": _share([o.abstained for o in yes]),
        "groundedness_mean": sum(grounded) / len(grounded) if grounded else None,
        "generated": kinds.count("generated") / len(kinds) if kinds else None,
        "extractive": kinds.count("extractive") / len(kinds) if kinds else None,
        "not_found": kinds.count("not_found") / len(kinds) if kinds else None,
        "first_token_p50_s": percentile(firsts, 50),
        "first_token_p95_s": percentile(firsts, 95),
        "total_p50_s": percentile(totals, 50),
        "total_p95_s": percentile(totals, 95),
    }


# The summary's metrics in table order: (key, label, is a share).
METRICS: list[tuple[str, str, bool]] = [
    ("answer_stated", "answer stated (answerable)", True),
    ("right_source_cited", "right source cited", True),
    ("right_page_or_section_cited", "right page or section cited", True),
    ("abstained_when_unanswerable", "abstained when unanswerable", True),
    ("false_abstention", "false abstention (answerable)", True),
    ("groundedness_mean", "groundedness (mean supported share)", True),
    ("generated", "model's own answer", True),
    ("extractive", "extractive answer", True),
    ("not_found", "not found / abstained", True),
    ("first_token_p50_s", "first token p50 (s)", False),
    ("first_token_p95_s", "first token p95 (s)", False),
    ("total_p50_s", "full answer p50 (s)", False),
    ("total_p95_s", "full answer p95 (s)", False),
]


def ratios(ours: Mapping[str, Any], peer: Mapping[str, Any]) -> dict[str, float | None]:
    """``ours / peer`` per metric (None where either is unknown or the peer's is 0)."""
    out: dict[str, float | None] = {}
    for key, _label, _share in METRICS:
        a, b = ours.get(key), peer.get(key)
        out[key] = a / b if isinstance(a, int | float) and isinstance(b, int | float) and b else None
    return out


def fmt(value: Any, share: bool) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:.1f}%" if share else f"{value:.2f}"
