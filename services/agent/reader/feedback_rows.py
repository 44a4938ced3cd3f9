"""Feedback on extractive answers as reader rows: which source sentences answer which question.

An extractive answer (``answer_kind: "extractive"``) is source sentences the reader picked, so a
rating or a correction of it says something about those sentences, in the words the reader
reads them (each sentence under its section's heading path, as ``candidates`` gives them):

- thumbs up: the cited sentences answer the question (label 1);
- thumbs down: they do not (label 0);
- a correction: the sentence of the turn's sources that holds most of the corrected text's words
  answers (label 1) and the cited ones, where they differ from it, do not (label 0); when no
  sentence holds enough of it, the correction says nothing the reader can learn from the
  sources, and only the thumbs down (label 0 for the cited sentences) is kept.

Rows are the trainer's ``reader`` format: ``{"question", "sentence", "label", "context",
"source"}`` (services/trainer/data/formats.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from services.agent.chunks import Chunk
from services.agent.grounding import strip_markers
from services.agent.protocol import TurnRecord
from services.agent.turns import FeedbackRow
from services.common.candidates import Candidate, answer_candidates
from services.common.text import content_terms, overlap

# Share of the correction's content words a source sentence must hold to be the one it means.
MIN_HOLD = 0.5


@dataclass(frozen=True)
class ReaderRow:
    question: str
    sentence: str
    label: Literal[0, 1]
    context: str = ""
    source: str = ""  # the document the sentence comes from

    def wire(self) -> dict[str, Any]:
        row: dict[str, Any] = {"question": self.question, "sentence": self.sentence, "label": self.label}
        if self.context:
            row["context"] = self.context
        if self.source:
            row["source"] = self.source
        return row


@dataclass
class ReaderDataset:
    rows: list[ReaderRow] = field(default_factory=list)
    held_out: list[str] = field(default_factory=list)  # message ids: the reader's regression set

    @property
    def counts(self) -> dict[str, int]:
        positive = sum(r.label == 1 for r in self.rows)
        return {
            "positive": positive,
            "negative": len(self.rows) - positive,
            "questions": len({r.question for r in self.rows}),
            "held_out": len(self.held_out),
        }

    def jsonl(self) -> bytes:
        return "".join(json.dumps(r.wire(), ensure_ascii=False) + "\n" for r in self.rows).encode()


def _key(text: str) -> str:
    return " " + " ".join(re.findall(r"[^\W_]+", strip_markers(text).lower())) + " "


@dataclass(frozen=True)
class Sentence:
    """A source sentence as the reader reads it: its text, its section's heading path, its document."""

    text: str
    context: str
    source: str

    def row(self, question: str, label: Literal[0, 1]) -> ReaderRow:
        return ReaderRow(question, self.text, label, self.context, self.source)


def _sentence(c: Candidate, chunks: list[Chunk]) -> Sentence:
    return Sentence(c.text, c.context, chunks[c.source - 1].document_id)


def cited_sentences(record: TurnRecord, chunks: list[Chunk], candidates: list[Candidate]) -> list[Sentence]:
    """The sentences an extractive answer shows: the candidates of its cited sources whose words
    the answer holds in order (the answer adds markers and may open with "Yes." or "The default
    is ..."). A record without its sources falls back on its citations' cited sentences."""
    cited = {c.get("index") for c in record.citations}
    shown = _key(record.answer)
    if chunks:
        return [_sentence(c, chunks) for c in candidates if c.source in cited and _key(c.text) in shown]
    out = []
    for c in record.citations:
        text = str((c.get("span") or {}).get("text") or "").strip()
        if text:
            context = str(c.get("section") or c.get("title") or "")
            out.append(Sentence(text, context, str(c.get("document_id") or "")))
    return out


def holding(correction: str, candidates: Sequence[Candidate]) -> Candidate | None:
    """The candidate holding the largest share of ``correction``'s content words (the first of
    equals: sources come ranked), when that share reaches ``MIN_HOLD``."""
    terms = content_terms(strip_markers(correction))
    best: Candidate | None = None
    best_share = 0.0
    for c in candidates:
        share = overlap(terms, c.text)
        if share > best_share:
            best, best_share = c, share
    return best if best_share >= MIN_HOLD else None


def rows_from_feedback(fb: FeedbackRow, record: TurnRecord) -> list[ReaderRow]:
    """The reader rows one piece of feedback gives (none for an answer the reader did not pick)."""
    question = record.question.strip()
    if record.answer_kind != "extractive" or record.kind != "pipeline" or not question:
        return []
    chunks = [Chunk.from_result(s) for s in record.sources]
    candidates = answer_candidates(chunks)
    cited = cited_sentences(record, chunks, candidates)
    correction = (fb.correction or "").strip()
    if correction:
        meant = holding(correction, candidates)
        if meant is not None:
            right = _sentence(meant, chunks)
            return [right.row(question, 1)] + [s.row(question, 0) for s in cited if s.text != right.text]
        if fb.rating == 1:
            return []  # approved, yet rewritten in words no source sentence holds: no verdict
    return [s.row(question, 1 if fb.rating == 1 and not correction else 0) for s in cited]


def reader_dataset(
    feedback: Sequence[tuple[FeedbackRow, TurnRecord]], hold_out: Callable[[str], bool] | None = None
) -> ReaderDataset:
    """The reader rows of ``feedback``, oldest first, one row per question and sentence (the
    newest verdict wins); the questions ``hold_out`` picks are kept out (their message ids in
    ``held_out``), all their rows together."""
    out = ReaderDataset()
    latest: dict[tuple[str, str], ReaderRow] = {}
    for fb, record in sorted(feedback, key=lambda pair: pair[1].created_at):
        rows = rows_from_feedback(fb, record)
        if not rows:
            continue
        if hold_out is not None and hold_out(question_key(record.question)):
            out.held_out.append(record.message_id)
            continue
        for row in rows:
            latest.pop((row.question, row.sentence), None)
            latest[(row.question, row.sentence)] = row
    out.rows = list(latest.values())
    return out


def question_key(question: str) -> str:
    """A question as the hold-out sees it: one verdict for every asking of it."""
    return " ".join(re.findall(r"[^\W_]+", question.lower()))
