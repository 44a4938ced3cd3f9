"""The reader's answer forms and its words: sentences written for these tests."""

from __future__ import annotations

import re

import pytest

from services.agent.chunks import Chunk
from services.agent.config import AgentSettings
from services.agent.pipelines.components import ReaderRankNode
from services.agent.pipelines.state import RunContext, RunState
from services.agent.reader import answer_text, read
from services.agent.reader.forms import default_value, lead, yes_or_no
from services.agent.reader.question import Asked
from services.agent.reader.scorer import ReaderScorer, Scored
from services.agent.reader.select import select
from services.agent.reader.unserved import UnservedReaders
from services.common.candidates import answer_candidates
from services.common.errors import NotFound
from services.common.judge import has_phrase, states_reference

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("question", "kind"),
    [
        ("What is the default port of the relay?", "default"),
        ("How many workers does the relay start?", "howmany"),
        ("Why does the relay drop idle links?", "why"),
        ("When is the cache flushed?", "when"),
        ("How do I rotate the relay's keys?", "how"),
        ("Which file holds the relay's keys?", "which"),
        ("What is a relay group?", "what"),
        ("Can the relay run without a cache?", "yesno"),
        ("Relay keys, rotated how often?", "other"),
    ],
)
def test_a_question_is_parsed_once_into_its_kind(question: str, kind: str) -> None:
    assert Asked.parse(question).kind == kind


@pytest.mark.parametrize(
    ("sentence", "value"),
    [
        ("The relay listens on port 7443 by default; the default is 7443.", "7443"),
        ("Its idle timeout defaults to 90 seconds.", "90 seconds"),
        ("port: the port to listen on (default: 7443)", "7443"),
        ("Default: the current directory.", "the current directory"),
        ("The relay keeps its keys in the key store.", None),
    ],
)
def test_a_default_value_is_read_from_its_sentence(sentence: str, value: str | None) -> None:
    assert default_value(Asked.parse("What is the default listening port?"), sentence) == value


def test_a_default_is_answered_as_such_and_only_for_a_default_question() -> None:
    sentence = "Its idle timeout defaults to 90 seconds."
    assert lead(Asked.parse("What is the default idle timeout?"), [sentence]) == "The default is 90 seconds."
    assert lead(Asked.parse("Why do idle links close?"), [sentence]) == ""


@pytest.mark.parametrize(
    ("question", "sentence", "verdict"),
    [
        ("Can the relay run without a cache?", "The relay runs without a cache, more slowly.", "Yes"),
        ("Can the relay run on one core?", "The relay runs on a single core.", "Yes"),
        ("Does the relay encrypt its logs?", "The relay does not encrypt its logs.", "No"),
        ("Doesn't the relay compress its logs?", "The relay does not compress its logs.", "Yes"),
        ("Which file holds the keys?", "The key store holds the keys.", None),
    ],
)
def test_a_yes_no_question_gets_yes_or_no_before_its_sentence(
    question: str, sentence: str, verdict: str | None
) -> None:
    assert yes_or_no(Asked.parse(question), sentence) == verdict


GERMAN = [
    Chunk(
        "de#0",
        "relais.md",
        "## Größe des Puffers\n\nDie Größe des Puffers beträgt standardmäßig 64 Kilobyte. "
        "Der Wert lässt sich über die Option --puffer ändern.",
        title="Relais",
        section="Relais > Größe des Puffers",
    ),
    Chunk(
        "fr#0",
        "relais-fr.md",
        "## Délai d'attente\n\nLe délai d'attente par défaut est de 90 secondes. "
        "Après ce délai, la connexion inactive est fermée.",
        title="Relais",
        section="Relais > Délai d'attente",
    ),
]


def test_words_with_letters_outside_ascii_are_words() -> None:
    texts = [c.text for c in answer_candidates(GERMAN)]
    assert "Die Größe des Puffers beträgt standardmäßig 64 Kilobyte." in texts
    assert "Le délai d'attente par défaut est de 90 secondes." in texts
    assert has_phrase("Die Größe beträgt 64 Kilobyte.", "Größe")
    assert not has_phrase("Die Größenordnung", "Größe")  # a whole word, not a prefix
    assert states_reference("La connexion inactive est fermée après 90 secondes.", "fermée après 90 secondes")


async def test_the_reader_scores_each_sentence_under_its_heading_and_the_threshold_decides() -> None:
    calls: list[tuple[str, str, list[str]]] = []

    async def rerank(model: str, question: str, passages: list[str]) -> list[float]:
        calls.append((model, question, passages))
        return [3.0 if "90 secondes" in p else -2.0 for p in passages]

    question = "Quel est le délai d'attente par défaut ?"
    found = await read(question, GERMAN, ReaderScorer("tandem-reader", 0.5, rerank))
    assert found.found and found.scorer == "reader:tandem-reader"
    assert found.picked[0].text == "Le délai d'attente par défaut est de 90 secondes."
    [(model, asked, passages)] = calls
    assert model == "tandem-reader" and asked == question
    assert "Relais > Délai d'attente\nLe délai d'attente par défaut est de 90 secondes." in passages
    text, numbers = answer_text(question, found)
    assert numbers == [2] and text.endswith("[2].")
    missing = await read(question, GERMAN, ReaderScorer("tandem-reader", 5.0, rerank))
    assert not missing.found and missing.see_also[0] == 2  # the closest source first


def test_the_selector_keeps_a_second_close_sentence_of_the_same_section_only() -> None:
    candidates = answer_candidates(GERMAN)
    scores = [2.0 - 0.05 * k if c.source == 1 else 1.5 for k, c in enumerate(candidates)]
    # the best sentence alone (no passage around it), so a second one is the selector's choice
    same = select(GERMAN, candidates, Scored(scores, [True] * len(scores), "t", margin=0.1), passage=0)
    assert [c.source for c in same.picked] == [1, 1]
    scored = Scored(scores, [True] * len(scores), "t", margin=0.0)
    apart = select(GERMAN, answer_candidates(GERMAN), scored, passage=0)
    assert [c.source for c in apart.picked] == [1]


class _Inference:
    def __init__(self, scores: dict[str, float] | None) -> None:
        self.scores = scores
        self.calls = 0

    async def rerank(self, model: str, question: str, passages: list[str]) -> list[float]:
        self.calls += 1
        if self.scores is None:
            raise NotFound(f"The rerank model `{model}` does not exist.", param="model")
        return [next((v for k, v in self.scores.items() if k in p), 0.0) for p in passages]


class _Retrieval:
    """The collection's embedder, as a test double: one dimension per word."""

    async def embed(self, collection: str, texts: list[str]) -> list[list[float]]:
        words = sorted({w for t in texts for w in re.findall(r"\w+", t.lower())})
        return [[float(w in re.findall(r"\w+", t.lower())) for w in words] for t in texts]


async def _ranked(
    inference: _Inference,
    collection: str | None = "relais",
    unserved: UnservedReaders | None = None,
    api_key: str = "key-a",
) -> list[str]:
    state = RunState(question="Quel est le délai d'attente par défaut ?", collection=collection)
    state.chunks = list(GERMAN)
    settings = AgentSettings(reader="tandem-reader")
    ctx = RunContext(
        settings=settings,
        retrieval=_Retrieval(),
        inference=inference,
        counter=None,
        model="m",
        unserved=unserved,
        api_key=api_key,
    )  # type: ignore[arg-type]
    node = ReaderRankNode(ReaderRankNode.P())
    assert [e async for e in node.run(state, ctx)] == []
    return [c.chunk_id for c in state.chunks]


async def test_the_reader_orders_the_sources_a_generating_model_reads() -> None:
    assert await _ranked(_Inference({"90 secondes": 4.0, "64 Kilobyte": -1.0})) == ["fr#0", "de#0"]
    # no reader served: the features scorer shipped with the agent orders them (the question's
    # words are the second source's)
    assert await _ranked(_Inference(None)) == ["fr#0", "de#0"]
    # nor a collection to embed with: retrieval's order stays
    assert await _ranked(_Inference(None), collection=None) == ["de#0", "fr#0"]
    # no reader (the rules alone): the step does nothing
    state = RunState(question="Quel est le délai ?", collection="relais")
    state.chunks = list(GERMAN)
    ctx = RunContext(
        settings=AgentSettings(reader=""), retrieval=None, inference=None, counter=None, model="m"
    )  # type: ignore[arg-type]
    assert [e async for e in ReaderRankNode(ReaderRankNode.P()).run(state, ctx)] == []
    assert [c.chunk_id for c in state.chunks] == ["de#0", "fr#0"]


async def test_a_reader_the_service_does_not_serve_is_not_asked_again_until_the_hold_ends() -> None:
    now = [100.0]
    unserved = UnservedReaders(hold_s=60.0, clock=lambda: now[0])
    missing = _Inference(None)
    # the first answer asks, gets the 404, and the features scorer orders the sources
    assert await _ranked(missing, unserved=unserved) == ["fr#0", "de#0"]
    assert missing.calls == 1 and unserved.holds("key-a", "tandem-reader")
    # the next answers go straight to the features scorer: no call
    assert await _ranked(missing, unserved=unserved) == ["fr#0", "de#0"]
    now[0] += 59.0
    assert await _ranked(missing, unserved=unserved) == ["fr#0", "de#0"]
    assert missing.calls == 1
    # another caller's key asks for itself (a tenant's reader is found by its own key)
    assert await _ranked(missing, unserved=unserved, api_key="key-b") == ["fr#0", "de#0"]
    assert missing.calls == 2
    # once the hold ends the reader is asked again, and a reader published meanwhile answers
    now[0] += 1.0
    served = _Inference({"64 Kilobyte": 4.0, "90 secondes": -1.0})
    assert await _ranked(served, unserved=unserved) == ["de#0", "fr#0"]
    assert served.calls == 1 and not unserved.holds("key-a", "tandem-reader")


def test_the_unserved_table_keeps_its_newest_pairs() -> None:
    unserved = UnservedReaders(hold_s=60.0, clock=lambda: 0.0, limit=2)
    for model in ("r1", "r2", "r3"):
        unserved.mark("k", model)
    assert [unserved.holds("k", m) for m in ("r1", "r2", "r3")] == [False, True, True]


RELAY = [
    Chunk(
        "relay#0",
        "relay",
        "## Timeouts\n"
        "The relay does not close a link that is busy. "
        "Idle links are closed after 90 seconds. "
        "A closed link is opened again on the next message. "
        "Links to a peer that never answers are dropped at once.\n"
        "## Keys\n"
        "Each relay signs its messages with its own key.",
        title="Relay",
    )
]


def _best(sentence: str) -> Scored:
    candidates = answer_candidates(RELAY)
    scores = [1.0 if c.text.startswith(sentence) else 0.0 for c in candidates]
    assert max(scores) == 1.0, [c.text for c in candidates]
    return Scored(scores, [s > 0 for s in scores], "t")


def test_an_answer_carries_the_sentences_around_its_best_one_in_source_order() -> None:
    picked = select(RELAY, answer_candidates(RELAY), _best("Idle links are closed")).picked
    assert [c.text for c in picked] == [
        "The relay does not close a link that is busy.",
        "Idle links are closed after 90 seconds.",
        "A closed link is opened again on the next message.",
    ]
    wider = select(RELAY, answer_candidates(RELAY), _best("Idle links are closed"), passage=2).picked
    assert len(wider) == 4 and wider[-1].text.startswith("Links to a peer")
    alone = select(RELAY, answer_candidates(RELAY), _best("Idle links are closed"), passage=0).picked
    assert [c.text for c in alone] == ["Idle links are closed after 90 seconds."]


def test_a_passage_stops_at_a_heading() -> None:
    picked = select(RELAY, answer_candidates(RELAY), _best("Links to a peer"), passage=2).picked
    assert [c.text[:12] for c in picked] == ["Idle links a", "A closed lin", "Links to a p"]
    first = select(RELAY, answer_candidates(RELAY), _best("The relay does"), passage=1).picked
    assert [c.text[:12] for c in first] == ["The relay do", "Idle links a"]


async def test_the_best_sentence_decides_yes_or_no_not_its_neighbours() -> None:
    class Picks:
        name = "picks"

        async def score(self, question: object, chunks: object, candidates: object) -> Scored:
            return _best("Idle links are closed")

    selection = await read("Are idle links closed after a while?", RELAY, Picks())
    text, numbers = answer_text("Are idle links closed after a while?", selection)
    # the sentence before the best one holds a "not", the best one none: the verdict is the best one's
    assert text.startswith("Yes. The relay does not close a link") and numbers == [1]


async def test_a_reader_without_a_threshold_orders_and_the_rules_say_whether_any_answers() -> None:
    from services.agent.reader.rules import RuleScorer

    async def rerank(model: str, question: str, passages: list[str]) -> list[float]:
        # a reader that prefers the buffer's sentences whatever is asked
        return [0.9 if "Puffer" in p else 0.1 for p in passages]

    asked = "Quel est le délai d'attente par défaut ?"
    scorer = ReaderScorer("tandem-reader", None, rerank, verdict=RuleScorer(None))
    found = await read(asked, GERMAN, scorer)
    # the rules find an answer among the sources, and the reader's order picks which
    assert found.found and found.scorer == "reader:tandem-reader"
    assert found.best is not None and "Puffers" in found.best.text
    # a name no source holds: the rules say nothing answers, whatever the reader scores
    missing = await read("Quel est le délai du Zorblax ?", GERMAN, scorer)
    assert not missing.found and missing.missing == ["zorblax"]
    with pytest.raises(ValueError, match="verdict"):
        ReaderScorer("tandem-reader", None, rerank)
