"""The groundedness guard: degenerate answers are replaced by cited source sentences, partly
supported ones are flagged, and the setting turns it off. Run as a pipeline node over a real
RunState (the services it would call are not needed: the guard only reads the sources)."""

from __future__ import annotations

from typing import Any

import pytest

from services.agent.chunks import Chunk
from services.agent.citations import CitationTracker
from services.agent.config import AgentSettings
from services.agent.grounding import check, extractive_answer, repeats_sentence
from services.agent.pipelines.components import GuardNode
from services.agent.pipelines.state import RunContext, RunState
from services.cli.factset import make_facts, states

pytestmark = pytest.mark.anyio

CHUNKS = [
    Chunk(
        "fr#0", "fr", "Paris is the capital of France. France is known for wine and cheese.", title="France"
    ),
    Chunk("de#0", "de", "Germany has many forests. Berlin is the capital of Germany.", title="Germany"),
]
QUESTION = "What is the capital of Germany?"


async def guard(
    answer: str, *, enabled: bool | None = None, finish_reason: str = "stop"
) -> tuple[RunState, list[dict[str, Any]]]:
    state = RunState(question=QUESTION, collection="geo")
    state.chunks = list(CHUNKS)
    state.tracker = CitationTracker(list(CHUNKS))
    state.answer = state.completion = answer
    state.finish_reason = finish_reason
    settings = AgentSettings()
    ctx = RunContext(settings=settings, retrieval=None, inference=None, counter=None, model="m")  # type: ignore[arg-type]
    node = GuardNode(GuardNode.P.model_validate({} if enabled is None else {"enabled": enabled}))
    events = [e async for e in node.run(state, ctx)]
    return state, events


@pytest.mark.parametrize(
    ("answer", "verdict", "finish_reason"),
    [
        ("", "empty", "stop"),
        ("[1]", "empty", "stop"),
        ("The answer is: The answer is:", "preamble", "stop"),
        ("Based on the sources, the answer to the question is:", "preamble", "stop"),
        ("Madrid is the capital of Germany.", "unsupported", "stop"),
        ("Berlin is nice. Berlin is nice.", "repeated", "stop"),
        ("Berlin is the capital of Germany [2].", "repeated", "repetition"),  # the loop guard cut it
    ],
)
async def test_degenerate_answers_become_extractive_with_citations(
    answer: str, verdict: str, finish_reason: str
) -> None:
    state, events = await guard(answer, finish_reason=finish_reason)
    assert state.grounding == verdict
    assert events[0] == {"type": "reset", "reason": verdict}
    streamed = "".join(e["text"] for e in events if e["type"] == "token")
    assert streamed == state.answer == "Berlin is the capital of Germany [2]."
    assert state.answer_kind == "extractive"
    assert [(c.index, c.document_id, c.kind) for c in state.citations] == [(2, "de", "extractive")]
    assert [e["kind"] for e in events if e["type"] == "citation"] == ["extractive"]
    assert state.completion == answer  # what the model wrote stays for the turn record


async def test_a_partly_supported_answer_is_kept_and_its_unsupported_sentence_flagged() -> None:
    answer = "Berlin is the capital of Germany [2]. It was founded by Martian settlers."
    state, events = await guard(answer)
    assert events == [] and state.answer == answer and state.answer_kind == "generated"
    assert state.grounding == "partial"
    [flag] = state.unsupported
    assert flag["text"] == "It was founded by Martian settlers." == answer[flag["start"] : flag["end"]]
    assert state.groundedness == 0.5


async def test_a_supported_answer_passes_untouched() -> None:
    state, events = await guard("Berlin is the capital of Germany [2].")
    assert events == [] and state.grounding == "ok" and state.unsupported == [] and state.groundedness == 1.0


@pytest.mark.parametrize("answer", ["The answer is: The answer is:", "", "Madrid is the capital of Germany."])
async def test_guard_off_leaves_every_answer_unchanged(answer: str) -> None:
    state, events = await guard(answer, enabled=False)
    assert (
        events == []
        and state.answer == answer
        and state.grounding is None
        and state.answer_kind == "generated"
    )


def test_a_misspelt_name_is_not_supported() -> None:
    [fact] = make_facts(1, seed=1)  # "The Kelgeand loom was invented by Drourgea Voubrurtres in 1885."
    spelt = fact.sentence
    misspelt = spelt.replace(fact.answer, "Droubgea Voubrurtre")
    assert check(spelt, fact.question, [fact.text]).verdict == "ok"
    assert check(misspelt, fact.question, [fact.text]).verdict == "unsupported"


def test_extractive_answer_states_invented_facts() -> None:
    facts = make_facts(18, seed=7)
    for fact in facts:
        others = [f for f in facts if f is not fact][:3]
        chunks = [Chunk(f.fact_id, f.fact_id, f.text, title=f.title) for f in [*others, fact]]
        text, numbers = extractive_answer(fact.question, chunks)
        assert states(text, fact.answer), (fact.question, text)
        assert 4 in numbers and f"[{numbers[0]}]" in text


def test_repeats_sentence_ignores_markers_and_case() -> None:
    assert repeats_sentence("Berlin is big [1]. berlin is big.")
    assert not repeats_sentence("Berlin is big. Paris is big.")


def test_a_sentence_is_supported_only_by_a_source_holding_its_names_and_numbers() -> None:
    sources = [
        "The first mayor of Nathsour was Polean Pearklinbrail, elected in 1882.",
        "Lake Moundtous reaches a depth of 117 metres. Its water is green in summer.",
    ]
    # Another town's mayor: every word is in some source, but no source has them together.
    assert (
        check(
            "The first mayor of Bearoun was Polean Pearklinbrail.",
            "Who was the first mayor of Bearoun?",
            sources,
        ).verdict
        == "unsupported"
    )
    assert (
        check("Lake Moundtous reaches a depth of 371 metres.", "How deep is Lake Moundtous?", sources).verdict
        == "unsupported"
    )
    assert (
        check(
            "Lake Moundtous reaches a depth of 117 metres [2].", "How deep is Lake Moundtous?", sources
        ).verdict
        == "ok"
    )
