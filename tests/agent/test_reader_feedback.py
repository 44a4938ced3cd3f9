"""The reader learning from use, without services: feedback on extractive answers as reader
rows, the tenant's reader in the choice, the gate's judgement of a replayed answer, and the
answer step reading with the tenant's promoted reader. Turn records and sources are written for
these tests."""

from __future__ import annotations

from typing import Any

import pytest

from services.agent.chunks import Chunk
from services.agent.config import AgentSettings
from services.agent.model_choice import reader_promoted, reader_rolled_back
from services.agent.pipelines.components import AnswerSelectNode
from services.agent.pipelines.state import RunContext, RunState
from services.agent.promotions import GateQuestion, read_matches, read_scores
from services.agent.prompting import PromptPlan
from services.agent.protocol import ModelChoice, ReaderChoice, TurnRecord
from services.agent.reader.feedback_rows import ReaderRow, question_key, reader_dataset, rows_from_feedback
from services.agent.reader.select import Selection
from services.agent.turns import FeedbackRow
from services.common.errors import Conflict, InvalidRequest

pytestmark = pytest.mark.anyio

RELAY = Chunk(
    "relay#0",
    "relay.md",
    "## Ports\n\nThe relay listens on port 7443 by default. Each link is closed after 90 idle seconds.",
    title="Relay",
    section="Relay > Ports",
)
CACHE = Chunk(
    "cache#0",
    "cache.md",
    "The cache keeps at most 512 entries. Entries older than a day are flushed every night.",
    title="Cache",
)
PORT = "The relay listens on port 7443 by default."
IDLE = "Each link is closed after 90 idle seconds."
FLUSH = "Entries older than a day are flushed every night."


def turn(
    message_id: str,
    question: str,
    answer: str,
    cited: list[int],
    kind: str = "extractive",
    sources: list[Chunk] | None = None,
    created_at: float = 1.0,
) -> TurnRecord:
    chunks = [RELAY, CACHE] if sources is None else sources
    citations = [
        {
            "index": n,
            "kind": "extractive",
            "chunk_id": [RELAY, CACHE][n - 1].chunk_id,
            "document_id": [RELAY, CACHE][n - 1].document_id,
            "title": [RELAY, CACHE][n - 1].title,
            "section": [RELAY, CACHE][n - 1].section or None,
            "span": {"start": 0, "end": 0, "text": {1: PORT, 2: FLUSH}[n]},
        }
        for n in cited
    ]
    return TurnRecord(
        message_id=message_id,
        pipeline="chat-documents",
        collection="docs",
        model="base",
        prompt=[{"role": "user", "content": question}],
        created_at=created_at,
        question=question,
        answer=answer,
        completion=answer,
        answer_kind=kind,  # type: ignore[arg-type]
        citations=citations,
        sources=[c.to_result() for c in chunks],
    )


def rating(message_id: str, value: int, correction: str | None = None) -> FeedbackRow:
    return FeedbackRow(message_id, value, correction, None, 1.0, 1.0)


ASKED = "Which port does the relay listen on?"


def test_a_thumbs_up_makes_the_shown_sentences_answers_and_a_thumbs_down_not() -> None:
    rec = turn("m1", ASKED, f"The default is 7443. {PORT[:-1]} [1].", [1])
    assert rows_from_feedback(rating("m1", 1), rec) == [
        ReaderRow(ASKED, PORT, 1, "Relay > Ports", "relay.md")
    ]
    assert rows_from_feedback(rating("m1", -1), rec) == [
        ReaderRow(ASKED, PORT, 0, "Relay > Ports", "relay.md")
    ]
    # a sentence of the cited source the answer does not show is not judged
    assert IDLE not in {r.sentence for r in rows_from_feedback(rating("m1", 1), rec)}
    # the context of a source without a section is its title
    flush = turn("m2", "When are old entries flushed?", f"{FLUSH[:-1]} [2].", [2])
    assert rows_from_feedback(rating("m2", 1), flush)[0].context == "Cache"


def test_a_correction_finds_the_source_sentence_it_means() -> None:
    asked = "When does the relay close a link?"
    rec = turn("m1", asked, f"{PORT[:-1]} [1].", [1])
    rows = rows_from_feedback(rating("m1", -1, "After 90 idle seconds [1]."), rec)
    assert [(r.sentence, r.label) for r in rows] == [(IDLE, 1), (PORT, 0)]
    # a correction no source sentence holds: only the thumbs down is kept
    rows = rows_from_feedback(rating("m1", -1, "Whenever the operator says so."), rec)
    assert [(r.sentence, r.label) for r in rows] == [(PORT, 0)]
    # approved but rewritten in words no sentence holds: no verdict on any sentence
    assert rows_from_feedback(rating("m1", 1, "Whenever the operator says so."), rec) == []
    # a correction holding the cited sentence itself: it answers, nothing is wrong
    rows = rows_from_feedback(rating("m1", -1, "It listens on port 7443 by default."), rec)
    assert [(r.sentence, r.label) for r in rows] == [(PORT, 1)]


def test_only_answers_the_reader_picked_give_rows() -> None:
    generated = turn("m1", ASKED, f"{PORT[:-1]} [1].", [1], kind="generated")
    not_found = turn("m2", ASKED, "Your documents do not say which port.", [], kind="not_found")
    assert rows_from_feedback(rating("m1", 1), generated) == []
    assert rows_from_feedback(rating("m2", -1, "Port 7443."), not_found) == []


def test_a_record_without_its_sources_falls_back_on_the_cited_sentences() -> None:
    rec = turn("m1", ASKED, f"{PORT[:-1]} [1].", [1], sources=[])
    assert rows_from_feedback(rating("m1", 1), rec) == [
        ReaderRow(ASKED, PORT, 1, "Relay > Ports", "relay.md")
    ]


def test_the_dataset_holds_questions_out_whole_and_keeps_the_newest_verdict() -> None:
    first = turn("m1", ASKED, f"{PORT[:-1]} [1].", [1], created_at=1.0)
    again = turn("m2", ASKED.upper(), f"{PORT[:-1]} [1].", [1], created_at=2.0)
    other = turn("m3", "When are old entries flushed?", f"{FLUSH[:-1]} [2].", [2], created_at=3.0)
    feedback = [(rating("m2", -1), again), (rating("m1", 1), first), (rating("m3", 1), other)]
    built = reader_dataset(feedback)
    assert [(r.question, r.label) for r in built.rows] == [
        (ASKED, 1),
        (ASKED.upper(), 0),
        ("When are old entries flushed?", 1),
    ]
    assert built.counts == {"positive": 2, "negative": 1, "questions": 3, "held_out": 0}
    # the hold-out sees a question whatever its case: both askings go out together
    held = reader_dataset(feedback, lambda q: q == question_key(ASKED))
    assert held.held_out == ["m1", "m2"] and [r.question for r in held.rows] == [other.question]
    wire = [r for r in held.jsonl().decode().splitlines()]
    assert wire == [
        '{"question": "When are old entries flushed?", "sentence": "' + FLUSH + '", "label": 1, '
        '"context": "Cache", "source": "cache.md"}'
    ]
    # the newest verdict on one question's sentence wins
    flipped = [(rating("m1", 1), first), (rating("m4", -1), turn("m4", ASKED, PORT, [1], created_at=5.0))]
    assert [r.label for r in reader_dataset(flipped).rows] == [0]


def test_the_trainer_reads_the_rows_as_a_reader_dataset() -> None:
    from services.trainer.data.formats import ReaderRecord, parse_dataset

    rec = turn("m1", "When does the relay close a link?", f"{PORT[:-1]} [1].", [1])
    built = reader_dataset([(rating("m1", -1, "After 90 idle seconds."), rec)])
    parsed = parse_dataset(built.jsonl())
    assert parsed.format == "reader"
    assert [(r.sentence, r.label, r.context) for r in parsed.records if isinstance(r, ReaderRecord)] == [
        (IDLE, 1, "Relay > Ports"),
        (PORT, 0, "Relay > Ports"),
    ]


# -- the tenant's reader -------------------------------------------------------------------------


def test_a_promoted_reader_is_the_tenants_until_rolled_back() -> None:
    one = reader_promoted(
        ModelChoice(default="ft-chat"), ReaderChoice(name="ft-reader-1", threshold=0.4), None, 1.0
    )
    assert one.reader == ReaderChoice(name="ft-reader-1", threshold=0.4) and one.default == "ft-chat"
    two = reader_promoted(one, ReaderChoice(name="ft-reader-2", threshold=0.6), 1.0, 2.0)
    assert [r.name for r in two.previous_readers] == ["", "ft-reader-1"]
    back = reader_rolled_back(two, "ft-reader-2", 3.0)
    assert back.reader == ReaderChoice(name="ft-reader-1", threshold=0.4)
    assert reader_rolled_back(back, "ft-reader-1", 4.0).reader is None  # the agent's setting again
    with pytest.raises(Conflict) as conflict:
        reader_rolled_back(back, "ft-reader-2", 5.0)
    assert "ft-reader-1" in conflict.value.message
    with pytest.raises(InvalidRequest) as bad:
        reader_promoted(one, ReaderChoice(name="ft-reader-2"), 0.5, 6.0)
    assert bad.value.param == "canary_share"


def test_a_replayed_answer_matches_the_reference_it_states() -> None:
    q = GateQuestion("m1", "When does the relay close a link?", "chat-documents", "docs", IDLE)
    said = RunState(question=q.question, collection="docs", answer=f"{IDLE[:-1]} [1].")
    said.selection = Selection(True, scorer="reader:ft-reader-1")
    wrong = RunState(question=q.question, collection="docs", answer=f"{PORT[:-1]} [1].")
    wrong.selection = Selection(True, scorer="reader:ft-reader-1")
    assert read_matches(q, said, "ft-reader-1") is True
    assert read_matches(q, wrong, "ft-reader-1") is False
    # the rules stood in for a candidate that failed: the candidate did not answer
    fallback = RunState(question=q.question, collection="docs", answer=said.answer)
    fallback.selection = Selection(True, scorer="rules")
    assert read_matches(q, fallback, "ft-reader-1") is False
    assert read_matches(q, fallback) is True  # the current reader's fallback is what chat serves
    unreferenced = GateQuestion("m2", q.question, "chat-documents", "docs", None)
    assert read_matches(unreferenced, said) is None
    assert read_scores([True, False, None]).model_dump(exclude_none=True) == {"answered": 3, "matches": 0.5}


# -- the answer step reads with the tenant's reader ------------------------------------------------


class Reranker:
    """The inference service's /v1/rerank for this test: scores a passage by the question words it holds."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def rerank(self, model: str, query: str, documents: list[str]) -> list[float]:
        self.calls.append(model)
        asked = {w for w in query.lower().strip("?").split() if len(w) > 3}
        return [0.8 if asked & set(d.lower().replace(".", "").split()) else 0.1 for d in documents]


async def answer_with(
    promoted: str | None, threshold: float | None, **params: Any
) -> tuple[RunState, Reranker]:
    inference = Reranker()
    ctx = RunContext(
        settings=AgentSettings.model_validate({"reader": "tandem-reader", "reader_threshold": 0.5}),
        retrieval=None,  # type: ignore[arg-type]
        inference=inference,  # type: ignore[arg-type]
        counter=None,  # type: ignore[arg-type]
        model="base",
        reader=promoted,
        reader_threshold=threshold,
    )
    state = RunState(question="When does the relay close an idle link?", collection="docs")
    state.plan = PromptPlan(messages=[], sources=[RELAY], prompt_tokens=0, budget=0)
    node = AnswerSelectNode(AnswerSelectNode.P.model_validate({"extract": True, **params}))
    async for _ in node.run(state, ctx):
        pass
    return state, inference


async def test_the_answer_step_reads_with_the_tenants_promoted_reader() -> None:
    state, inference = await answer_with("ft-reader-7", 0.5)
    assert inference.calls == ["ft-reader-7"] and state.selection is not None
    assert state.selection.scorer == "reader:ft-reader-7" and state.answer_kind == "extractive"
    assert IDLE[:-1] in state.answer
    # its own threshold: at 0.9 nothing answers
    state, _ = await answer_with("ft-reader-7", 0.9)
    assert state.answer_kind == "not_found"
    # none promoted: the agent's reader setting
    _, inference = await answer_with(None, None)
    assert inference.calls == ["tandem-reader"]
    # a pipeline that names its reader keeps it
    _, inference = await answer_with("ft-reader-7", 0.5, reader="ft-reader-pinned")
    assert inference.calls == ["ft-reader-pinned"]
