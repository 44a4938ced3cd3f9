"""The groundedness guard: degenerate answers are replaced by cited source sentences, partly
supported ones are flagged, and the setting turns it off. Run as a pipeline node over a real
RunState. Word overlap needs no service; the embedding side runs against a real inference
service (all-MiniLM-L6-v2 on /v1/embeddings) and a real retrieval service whose collection
embeds through it, over real HTTP."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.agent.chunks import Chunk
from services.agent.citations import CitationTracker
from services.agent.clients import InferenceClient, RetrievalClient
from services.agent.config import AgentSettings
from services.agent.grounding import check, repeats_sentence
from services.agent.pipelines.components import GuardNode
from services.agent.pipelines.state import RunContext, RunState
from services.agent.reader import answer_text, read
from services.agent.reader.rules import RuleScorer
from services.cli.factset import make_facts, states
from services.common.config import CommonSettings
from tests.conftest import auth
from tests.helpers.servers import free_port, serve_app

pytestmark = pytest.mark.anyio

CHUNKS = [
    Chunk(
        "fr#0", "fr", "Paris is the capital of France. France is known for wine and cheese.", title="France"
    ),
    Chunk("de#0", "de", "Germany has many forests. Berlin is the capital of Germany.", title="Germany"),
]
QUESTION = "What is the capital of Germany?"


async def guard(
    answer: str,
    *,
    enabled: bool | None = None,
    finish_reason: str = "stop",
    chunks: list[Chunk] = CHUNKS,
    question: str = QUESTION,
    collection: str = "geo",
    upstreams: tuple[RetrievalClient, InferenceClient] | None = None,
    params: dict[str, Any] | None = None,
    settings: AgentSettings | None = None,
) -> tuple[RunState, list[dict[str, Any]]]:
    """Runs the guard node; without ``upstreams`` on word overlap only (the embedder setting off)."""
    state = RunState(question=question, collection=collection)
    state.chunks = list(chunks)
    state.tracker = CitationTracker(list(chunks))
    state.answer = state.completion = answer
    state.finish_reason = finish_reason
    settings = (settings or AgentSettings()).model_copy(update={"grounding_embedder": upstreams is not None})
    retrieval, inference = upstreams or (None, None)
    ctx = RunContext(settings=settings, retrieval=retrieval, inference=inference, counter=None, model="m")  # type: ignore[arg-type]
    node = GuardNode(
        GuardNode.P.model_validate({**(params or {}), **({} if enabled is None else {"enabled": enabled})})
    )
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
    # the answering sentence with its passage: the sentence before it in the source
    assert streamed == state.answer == "Germany has many forests. Berlin is the capital of Germany [2]."
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


async def test_the_agent_setting_turns_the_guard_off_unless_a_pipeline_turns_it_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TANDEM_AGENT_GROUNDING_GUARD", "false")
    off = AgentSettings()
    state, events = await guard("The answer is: The answer is:", settings=off)
    assert events == [] and state.grounding is None and state.answer == "The answer is: The answer is:"
    # A pipeline's own ``enabled: true`` wins over the setting.
    state, events = await guard("The answer is: The answer is:", settings=off, enabled=True)
    assert state.answer_kind == "extractive"
    assert state.answer == "Germany has many forests. Berlin is the capital of Germany [2]."


def test_a_misspelt_name_is_not_supported() -> None:
    [fact] = make_facts(1, seed=1)  # "The Kelgeand loom was invented by Drourgea Voubrurtres in 1885."
    spelt = fact.sentence
    misspelt = spelt.replace(fact.answer, "Droubgea Voubrurtre")
    assert check(spelt, fact.question, [fact.text]).verdict == "ok"
    assert check(misspelt, fact.question, [fact.text]).verdict == "unsupported"


async def test_the_fallback_reader_states_invented_facts() -> None:
    facts = make_facts(18, seed=7)
    for fact in facts:
        others = [f for f in facts if f is not fact][:3]
        chunks = [Chunk(f.fact_id, f.fact_id, f.text, title=f.title) for f in [*others, fact]]
        selection = await read(fact.question, chunks, RuleScorer(None))
        text, numbers = answer_text(fact.question, selection)
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


# -- the embedding side: the collection's embedder, through real services ------------------------

[TOWN] = [f for f in make_facts(2, seed=1) if f.question.startswith("On which river")]
# "The town of Bonddros lies on the river Nondrath." among two distractor sentences.
TOWN_CHUNKS = [Chunk(TOWN.fact_id, TOWN.fact_id, TOWN.text, title=TOWN.title), *CHUNKS]
# Says what the source says in other words: overlap finds "flows right through" nowhere.
PARAPHRASE = "The river Nondrath flows right through the town of Bonddros."
UNSUPPORTED = "The town is famous for its yearly cheese market."


@pytest.fixture(scope="module")
def services(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, tiny_model_path: Path
) -> Iterator[tuple[str, str, str]]:
    """(retrieval URL, inference URL, key): inference serves all-MiniLM-L6-v2 on /v1/embeddings and
    the retrieval service embeds through it; one collection, ``towns``, built with that model."""
    import redis

    from services.common.auth import KeyStore
    from services.inference.app import create_app as inference_app
    from services.inference.config import InferenceSettings
    from services.retrieval.app import create_app as retrieval_app
    from services.retrieval.config import RetrievalSettings

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    key = KeyStore(client).create("acme")[0]
    client.close()
    home = tmp_path_factory.mktemp("guard-home")

    def common(name: str) -> CommonSettings:
        (home / name).mkdir()
        return CommonSettings(home=home / name, redis_url=redis_url, log_json=False, service_api_key=key)

    inference = inference_app(
        common("inference"),
        InferenceSettings(model=str(tiny_model_path), max_model_len=128, embedding_dtype="float32"),
    )
    with serve_app(inference) as i_url:
        retrieval = retrieval_app(common("retrieval"), RetrievalSettings(embedder_url=f"{i_url}/v1"))
        with serve_app(retrieval) as r_url:
            r = httpx.post(f"{r_url}/v1/collections", json={"name": "towns"}, headers=auth(key), timeout=120)
            assert r.status_code == 201, r.text
            assert r.json()["embedding_model"] == "all-MiniLM-L6-v2"
            yield r_url, i_url, key


async def test_a_paraphrase_the_overlap_misses_is_kept_with_the_collections_embedder(
    services: tuple[str, str, str],
) -> None:
    r_url, i_url, key = services
    upstreams = (RetrievalClient(r_url, key), InferenceClient(i_url, key))
    # Word overlap alone finds the paraphrase unsupported and replaces it.
    lexical, events = await guard(PARAPHRASE, chunks=TOWN_CHUNKS, question=TOWN.question)
    assert lexical.grounding == "unsupported" and lexical.answer_kind == "extractive"
    assert states(lexical.answer, TOWN.answer) and events[0]["type"] == "reset"
    # With the collection's embedder it is supported and shown as written.
    state, events = await guard(
        PARAPHRASE, chunks=TOWN_CHUNKS, question=TOWN.question, collection="towns", upstreams=upstreams
    )
    assert events == [] and state.answer == PARAPHRASE and state.answer_kind == "generated"
    assert state.grounding == "ok" and state.groundedness == 1.0 and state.unsupported == []
    # An unsupported sentence next to it is still flagged (and the answer kept, partly supported).
    answer = f"{PARAPHRASE} {UNSUPPORTED}"
    state, events = await guard(
        answer, chunks=TOWN_CHUNKS, question=TOWN.question, collection="towns", upstreams=upstreams
    )
    assert events == [] and state.answer == answer and state.grounding == "partial"
    assert [u["text"] for u in state.unsupported] == [UNSUPPORTED]
    assert state.groundedness == 0.5


async def test_a_wrong_fact_about_the_right_entity_is_not_supported_by_similarity(
    services: tuple[str, str, str],
) -> None:
    r_url, i_url, key = services
    upstreams = (RetrievalClient(r_url, key), InferenceClient(i_url, key))
    # Close in meaning to the source sentence (same town, same shape), but the source never says it.
    state, events = await guard(
        "The town of Bonddros lies in a wide valley full of farms.",
        chunks=TOWN_CHUNKS,
        question=TOWN.question,
        collection="towns",
        upstreams=upstreams,
    )
    assert state.grounding == "unsupported" and state.answer_kind == "extractive"
    assert states(state.answer, TOWN.answer) and events[0] == {"type": "reset", "reason": "unsupported"}


async def test_when_embedding_fails_the_guard_falls_back_to_word_overlap_and_logs_it(
    services: tuple[str, str, str], caplog: pytest.LogCaptureFixture
) -> None:
    _, i_url, key = services
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the retrieval service is down
    for upstreams in [
        (RetrievalClient(down, key), InferenceClient(down, key)),
        (RetrievalClient(i_url, key), InferenceClient(i_url, key)),  # a service without /embed
    ]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tandem.agent.guard"):
            state, events = await guard(
                PARAPHRASE,
                chunks=TOWN_CHUNKS,
                question=TOWN.question,
                collection="towns",
                upstreams=upstreams,
            )
        # The lexical verdict, as with the embedder off: replaced, never an error.
        assert state.grounding == "unsupported" and state.answer_kind == "extractive"
        assert states(state.answer, TOWN.answer) and not any(e["type"] == "error" for e in events)
        assert any("embedding failed" in r.getMessage() for r in caplog.records), upstreams


async def test_a_stuck_embedding_service_does_not_hold_the_answer(
    services: tuple[str, str, str], caplog: pytest.LogCaptureFixture
) -> None:
    _, i_url, key = services
    with socket.socket() as stuck:  # accepts connections (the kernel's backlog), never answers
        stuck.bind(("127.0.0.1", 0))
        stuck.listen(8)
        retrieval = RetrievalClient(f"http://127.0.0.1:{stuck.getsockname()[1]}", key, timeout=120)
        with caplog.at_level(logging.WARNING, logger="tandem.agent.guard"):
            started = time.monotonic()
            state, _ = await guard(
                PARAPHRASE,
                chunks=TOWN_CHUNKS,
                question=TOWN.question,
                collection="towns",
                upstreams=(retrieval, InferenceClient(i_url, key)),
                params={"embed_timeout_s": 0.5},
            )
            waited = time.monotonic() - started
    assert state.grounding == "unsupported" and state.answer_kind == "extractive"
    assert waited < 60, waited  # the guard's own limit, not the client's 120 s
    assert any("no answer in 0.5 s" in r.getMessage() for r in caplog.records)


async def test_an_answer_the_overlap_supports_needs_no_embedding(services: tuple[str, str, str]) -> None:
    _, _, key = services
    down = f"http://127.0.0.1:{free_port()}"
    # Both services down, yet no warning and no cost: nothing was left for the embedder to judge.
    state, events = await guard(
        "Berlin is the capital of Germany [2].",
        upstreams=(RetrievalClient(down, key), InferenceClient(down, key)),
    )
    assert events == [] and state.grounding == "ok"


def test_a_wrapped_line_may_start_with_an_option_but_an_option_table_keeps_its_lines() -> None:
    from services.common.text import unwrap

    assert (
        unwrap("tools can be invoked with the\n--tool option.")
        == "tools can be invoked with the --tool option."
    )
    table = "Usage: asn1Parser [OPTION] FILE\n-c, --check checks the syntax only\n-n, --name=NAME array name"
    assert unwrap(table) == table
    assert unwrap("a list:\n- one\n- two") == "a list:\n- one\n- two"
