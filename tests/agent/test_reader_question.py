"""The question as the answer step reads it (services/agent/reader/question.py): parsed once per
answer step into typed fields, which the rules and the scorers read for every candidate sentence.
Questions and sentences written for these tests."""

from __future__ import annotations

import asyncio
import dataclasses
import typing
from collections.abc import Callable

import pytest

from services.agent.chunks import Chunk
from services.agent.reader import answer_text, features, read, rules
from services.agent.reader.question import Asked
from services.agent.reader.scorer import AnswerScorer
from services.agent.reader.similarity import by_embedding
from services.common.candidates import answer_candidates
from tests.helpers.embedders import bag_of_words

GUIDE = (
    "The tollgate relay forwards frames between the two harbour networks. "
    "It keeps a small journal of every frame it forwards. "
    "The journal is written to the spool folder under the relay's home. "
    "Operators read the journal with the tollgate-tail program. "
    "The relay starts 12 worker threads when it boots. "
    "Each worker thread owns one outgoing link to a harbour network. "
    "A worker that loses its link retries after a short pause. "
    "The pause doubles after every failed retry up to a minute. "
    "The relay listens on port 7311 unless another port is configured. "
    "The TOLLGATE_PORT variable sets another listening port for the relay. "
    "Frames larger than the link's limit are split before they are sent. "
    "The relay never reorders the frames of one link."
)
NOTES = (
    "Version 4.2 of the relay was published in March 2031 by Ilse Varga. "
    "That release added the tollgate-tail program to the package. "
    "Older releases kept the journal in memory only. "
    "The harbour networks are run by two separate port authorities. "
    "Each authority keeps its own copy of the relay's settings file. "
    "The settings file is named tollgate.toml in both copies. "
    "A change to one copy must be made to the other by hand. "
    "The release notes list every change to the settings file. "
    "Frames that arrive during a restart wait in the spool folder. "
    "The relay reads the spool folder again after every restart."
)


def chunks() -> list[Chunk]:
    return [
        Chunk("g#1", "guide.md", GUIDE, score=0.03, scores={"dense": 0.6}, section="Guide > Relay"),
        Chunk("n#1", "notes.md", NOTES, score=0.02, scores={"dense": 0.4}, section="Notes"),
    ]


def counting_parse(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every question ``Asked.parse`` parses from now on, in order."""
    seen: list[str] = []
    original = Asked.parse.__func__  # type: ignore[attr-defined]

    def spy(cls: type[Asked], question: str) -> Asked:
        seen.append(question)
        return typing.cast(Asked, original(cls, question))

    monkeypatch.setattr(Asked, "parse", classmethod(spy))
    return seen


SCORERS: list[tuple[str, Callable[[], AnswerScorer]]] = [
    ("rules", lambda: rules.RuleScorer(by_embedding(bag_of_words))),
    ("rules-words", lambda: rules.RuleScorer(None)),
    ("features", lambda: features.FeatureScorer(features.shipped_model(), by_embedding(bag_of_words))),
]


@pytest.mark.parametrize(("name", "make"), SCORERS, ids=[n for n, _ in SCORERS])
def test_the_question_is_parsed_once_per_answer_step(
    monkeypatch: pytest.MonkeyPatch, name: str, make: Callable[[], AnswerScorer]
) -> None:
    cs = chunks()
    assert len(answer_candidates(cs)) >= 20
    seen = counting_parse(monkeypatch)
    question = "How many worker threads does the tollgate relay start?"
    selection = asyncio.run(read(question, cs, make()))
    # the rules looked at every candidate (their scores differ) and read the question each time
    assert len({c.score for c in selection.ranked}) > 1
    assert selection.found and selection.best is not None and "12 worker threads" in selection.best.text
    assert seen == [question]


def test_a_parsed_question_is_not_parsed_again() -> None:
    asked = Asked.parse("Which variable sets another listening port?")
    seen: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        seen = counting_parse(mp)
        selection = asyncio.run(read(asked, chunks(), rules.RuleScorer(by_embedding(bag_of_words))))
        text, _numbers = answer_text(asked, selection)
    assert seen == [] and "TOLLGATE_PORT" in text


# The rules' and the learned scorer's functions that read the question take it parsed: the
# question's text alone is no argument of theirs.
READ_THE_QUESTION = [
    rules.answer_type_match,
    rules.names_instance,
    rules.asked_terms,
    rules.focus_terms,
    rules.missing_names,
    rules.score,
    rules.verdicts,
    rules.with_typed_neighbour,
    features.candidate_features,
]


@pytest.mark.parametrize("fn", READ_THE_QUESTION, ids=[f.__name__ for f in READ_THE_QUESTION])
def test_the_sentence_side_functions_take_only_the_parsed_question(fn: Callable[..., object]) -> None:
    first = next(iter(typing.get_type_hints(fn).values()))
    assert first is Asked


def test_a_string_is_refused_where_the_parsed_question_is_read() -> None:
    with pytest.raises(AttributeError):
        rules.answer_type_match("Which program reads the journal?", "Use the tollgate-tail program.")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("question", "expected"),
    [
        ("Which month was version 4.2 published in?", {"month": True, "kind": "which"}),
        ("In what year did the relay ship?", {"year": True, "number": True, "kind": "other"}),
        ("How long may a frame be?", {"number": True, "size": True, "kind": "howmany", "opening": "how"}),
        ("How many threads does it start?", {"number": True, "opening": "how_many"}),
        ("Who published version 4.2?", {"person": True, "versions": ("4.2",)}),
        ("Which option sets the port?", {"term_kinds": ("option",)}),
        ("What does tollgate_open return on error?", {"term_kinds": ("returned",)}),
        (
            "Which function opens a link, tollgate_open or tollgate_dial?",
            {"term_kinds": ("function",), "known_terms": frozenset({"tollgate_open", "tollgate_dial"})},
        ),
        # without a tagger the verb before an article counts too
        ("Which program reads the journal?", {"kind_nouns": frozenset({"program", "read"})}),
        ("What does the Tollgate relay forward?", {"verb": "forward", "names": frozenset({"tollgate"})}),
        ("Can the relay run without a journal?", {"kind": "yesno", "opening": "yes_no", "negated": True}),
        ("Wie viele Threads startet das Relais?", {"kind": "other", "number": False, "verb": None}),
    ],
)
def test_what_a_question_asks_for(question: str, expected: dict[str, object]) -> None:
    asked = Asked.parse(question)
    assert {k: getattr(asked, k) for k in expected} == expected


def test_its_terms_and_focus_are_parsed_in_order() -> None:
    asked = Asked.parse("Which settings file do both port authorities keep?")
    assert asked.terms[:2] == ("set", "file")  # stemmed, stopwords out, in order
    assert set(asked.focus) <= set(asked.terms)
    assert asked.kind_words == frozenset() and asked.embedded == asked.text
    assert asked.asks_term and not asked.asks_number


def test_the_parsed_question_is_frozen() -> None:
    asked = Asked.parse("Which port does the relay listen on?")
    with pytest.raises(dataclasses.FrozenInstanceError):
        asked.kind = "why"  # type: ignore[misc]
