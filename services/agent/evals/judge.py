"""Judging one answer to one question of a set, and adding the verdicts up.

The words-level judge is services/common/judge.py (key phrases, reference answers, declining);
this module judges a whole question on it: the expected answer stated, the right document (and
page or section) cited, "not found" where the documents do not say, groundedness, and, when
asked, the answer's cosine to the reference under the collection's embedder and a judge model's
verdict. ``tandem eval rag --questions``, the evaluation API and regression checks all judge
with these functions, so a set scores the same wherever it runs; none of it is used to write
answers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from services.agent.evals.protocol import EvalQuestion, EvalResult, JudgeVerdict, Totals
from services.common.judge import abstains, has_phrase, reference_overlap, states_reference

ANSWER_KINDS = ("generated", "extractive", "not_found")


def states(answer: str, answers: Sequence[str] | None, reference: str | None, question: str) -> bool:
    """The answer states the expected fact: any one key phrase, else the reference answer."""
    if answers:
        return any(has_phrase(answer, a) for a in answers)
    return states_reference(answer, reference or "", question)


# -- citations: the right document, page and section -----------------------------------------


def _key(name: str) -> str:
    name = re.sub(r"\.(?:md|markdown|html?|pdf|txt|rst|docx|jsonl)$", "", name.lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def _names_of(cite: Mapping[str, Any]) -> list[str]:
    meta = cite.get("metadata") if isinstance(cite.get("metadata"), Mapping) else {}
    assert isinstance(meta, Mapping)
    names = [cite.get("document_id"), cite.get("title"), cite.get("source")]
    names += [meta.get(k) for k in ("source", "filename", "path", "file")]
    return [str(n) for n in names if n]


def source_matches(expected: str, cite: Mapping[str, Any]) -> bool:
    """The citation names ``expected``: equal keys, or one ends with the other at a separator
    (``docs/operations.md`` and the id ``docs-operations.md``; ``faq.html`` and ``valgrind-faq``)."""
    want = _key(expected)
    bare = _key(expected.rsplit("/", 1)[-1])
    for name in _names_of(cite):
        got = _key(name)
        if not got:
            continue
        for w in {want, bare}:
            if got == w or got.endswith("-" + w) or w.endswith("-" + got):
                return True
    return False


def _words(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower().replace("_", " ")))


def _field(cite: Mapping[str, Any], name: str) -> Any:
    if cite.get(name) is not None:
        return cite.get(name)
    meta = cite.get("metadata")
    return meta.get(name) if isinstance(meta, Mapping) else None


def _pages(cite: Mapping[str, Any]) -> set[int]:
    out: set[int] = set()
    for key in ("page", "pages"):
        value = _field(cite, key)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) or (isinstance(v, str) and v.isdigit()):
                out.add(int(v))
    start, end = _field(cite, "page_start"), _field(cite, "page_end")
    if isinstance(start, int) and isinstance(end, int) and end >= start:
        out.update(range(start, end + 1))
    return out


def locates(page: int | None, section: str | None, cite: Mapping[str, Any]) -> bool | None:
    """The citation names ``page`` or ``section``: None when neither can be told (none given, or
    the citation carries neither field)."""
    judged = False
    if page is not None:
        pages = _pages(cite)
        if pages:
            judged = True
            if page in pages:
                return True
    if section:
        value = _field(cite, "section")
        headings = value if isinstance(value, list) else [value]
        more = _field(cite, "headings")
        headings += more if isinstance(more, list) else []
        cited = [_words(str(h)) for h in headings if h]
        if cited:
            judged = True
            want = _words(section)
            if any(want and (want in c or (len(c) > 3 and c in want)) for c in cited):
                return True
    return False if judged else None


def cites_right(
    sources: Sequence[str], page: int | None, section: str | None, cites: Sequence[Mapping[str, Any]]
) -> tuple[bool | None, bool | None]:
    """(right source, right page or section) of an answer's citations; None where it cannot be
    told (no source expected; no page or section either can name)."""
    if not sources:
        return None, None
    matching = [c for c in cites if any(source_matches(s, c) for s in sources)]
    verdicts = [locates(page, section, c) for c in (matching or cites)]
    if any(v is True for v in verdicts) and matching:
        return True, True
    return bool(matching), (False if any(v is not None for v in verdicts) else None)


def answer_kind_of(kind: Any, answer: str) -> str:
    if kind in ANSWER_KINDS:
        return str(kind)
    return "not_found" if abstains(answer) else "generated"


# -- one answer ------------------------------------------------------------------------------


@dataclass
class Answered:
    """What an answerer said to one question: the shown answer, its citations (dicts with
    ``document_id``, ``title``, ``page``, ``section``...), its kind, the texts it read (for
    groundedness), the groundedness the pipeline measured (None: judge it here), and the time."""

    answer: str
    citations: list[dict[str, Any]] = field(default_factory=list)
    answer_kind: str | None = None
    documents: list[str] = field(default_factory=list)
    groundedness: float | None = None
    latency_seconds: float = 0.0
    error: str | None = None
    model: str = ""  # the model that wrote it ("" where none did)


CITATION_FIELDS = ("index", "document_id", "title", "page", "section", "kind")


def score(q: EvalQuestion, n: int, out: Answered) -> EvalResult:
    """One answer judged: ``n`` is the question's 1-based place in its set."""
    from services.agent.grounding import check

    base = EvalResult(
        n=n,
        id=q.id or f"q{n}",
        question=q.question,
        kind=q.kind,
        answerable=q.answerable,
        latency_seconds=round(out.latency_seconds, 4),
    )
    if out.error is not None:
        return base.model_copy(update={"error": out.error})
    answer = out.answer
    kind = answer_kind_of(out.answer_kind, answer)
    abstained = kind == "not_found" or (kind != "extractive" and abstains(answer))
    right_source, right_page = (
        cites_right(q.sources, q.page, q.section, out.citations) if q.answerable else (None, None)
    )
    grounded = out.groundedness
    if grounded is None and answer.strip() and not abstained:
        grounded = check(answer, q.question, out.documents).share
    overlap = None
    if q.answerable and q.reference:
        overlap = reference_overlap(answer, q.reference, q.question)
    return base.model_copy(
        update={
            "answer": answer,
            "answer_kind": kind,
            "citations": [{k: c.get(k) for k in CITATION_FIELDS if k in c} for c in out.citations],
            "stated": states(answer, q.answers, q.reference, q.question) if q.answerable else None,
            "right_source": right_source,
            "right_page": right_page,
            "abstained": abstained,
            "false_abstention": abstained if q.answerable else None,
            "grounded": grounded,
            "overlap": overlap,
        }
    )


def cosine(u: Sequence[float], v: Sequence[float]) -> float | None:
    nu = math.sqrt(sum(x * x for x in u))
    nv = math.sqrt(sum(x * x for x in v))
    if not nu or not nv or len(u) != len(v):
        return None
    return sum(a * b for a, b in zip(u, v, strict=True)) / (nu * nv)


# -- a judge model -----------------------------------------------------------------------------

JUDGE_PROMPT = (
    "You grade answers to questions about documents. Given the question, the expected answer and "
    "the answer to grade, reply with one word, CORRECT if the answer states the expected answer "
    "(in any words) or INCORRECT if it does not, then a short reason."
)
_VERDICT = re.compile(r"\b(incorrect|correct|wrong|right)\b", re.IGNORECASE)


def judge_messages(q: EvalQuestion, answer: str) -> list[dict[str, str]]:
    expected = q.reference or " / ".join(q.answers or [])
    if not q.answerable:
        expected = "The documents do not answer this question: the answer should say so."
    user = f"Question: {q.question}\nExpected answer: {expected}\nAnswer to grade: {answer}"
    return [{"role": "system", "content": JUDGE_PROMPT}, {"role": "user", "content": user}]


def read_verdict(model: str, text: str) -> JudgeVerdict:
    """The first verdict word of the judge's reply (``unclear`` when it gives none)."""
    m = _VERDICT.search(text)
    word = m.group(1).lower() if m else ""
    verdict: Literal["correct", "incorrect", "unclear"] = (
        "correct" if word in ("correct", "right") else "incorrect" if word else "unclear"
    )
    return JudgeVerdict(model=model, verdict=verdict, reason=text.strip()[:1000])


# -- totals ------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _share(flags: Sequence[bool | None]) -> float | None:
    judged = [f for f in flags if f is not None]
    return sum(judged) / len(judged) if judged else None


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def totals(results: Sequence[EvalResult]) -> Totals:
    ok = [r for r in results if r.error is None]
    yes = [r for r in ok if r.answerable]
    no = [r for r in ok if not r.answerable]
    times = [r.latency_seconds for r in ok]
    verdicts = [r.judge.verdict == "correct" for r in ok if r.judge and r.judge.verdict != "unclear"]
    return Totals(
        questions=len(results),
        answerable=sum(1 for r in results if r.answerable),
        unanswerable=sum(1 for r in results if not r.answerable),
        errors=len(results) - len(ok),
        stated=_share([r.stated for r in yes]),
        right_source=_share([r.right_source for r in yes]),
        right_page=_share([r.right_page for r in yes]),
        not_found=_share([r.abstained for r in no]),
        false_not_found=_share([r.abstained for r in yes]),
        grounded=_mean([r.grounded for r in ok]),
        overlap=_mean([r.overlap for r in yes]),
        similarity=_mean([r.similarity for r in yes]),
        judged_correct=_share(verdicts),
        p50_seconds=percentile(times, 50),
        p95_seconds=percentile(times, 95),
    )


def totals_by_kind(results: Sequence[EvalResult]) -> dict[str, Totals]:
    """Totals per kind of question (``how``, ``why``...); questions without one are ``other``."""
    kinds: dict[str, list[EvalResult]] = {}
    for r in results:
        kinds.setdefault(r.kind or "other", []).append(r)
    return {k: totals(rs) for k, rs in sorted(kinds.items())}
