"""The learned scorer (services/agent/reader/features.py): its features over real candidates, a
model read from its JSON artifact, and the answer step's selection and "not found" with it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from services.agent.chunks import Chunk
from services.agent.reader import read
from services.agent.reader.features import (
    FEATURES,
    FeatureModel,
    FeatureModelError,
    FeatureScorer,
    candidate_features,
)
from services.agent.reader.question import Asked
from services.agent.reader.similarity import by_embedding
from services.common.candidates import answer_candidates
from tests.helpers.embedders import bag_of_words


def chunks() -> list[Chunk]:
    return [
        Chunk(
            "c1",
            "guide.md",
            "The daemon keeps its queue in memory. The brellow daemon starts six worker threads "
            "unless told otherwise. Each worker writes to the shared journal.",
            score=0.03,
            scores={"dense": 0.6},
            section="Guide > Brellow daemon > Workers",
        ),
        Chunk(
            "c2",
            "notes.md",
            "Release notes are published every spring on the project page. Older notes stay "
            "available in the archive section.",
            score=0.01,
            scores={"dense": 0.2},
            section="Notes",
        ),
    ]


def model(threshold: float = 0.5) -> FeatureModel:
    """Similar to the question and holding its rarer words: the two signals a fitted model leans
    on most, with the weights written here."""
    w = np.zeros((len(FEATURES), 1), dtype=np.float32)
    w[FEATURES.index("cos_sentence"), 0] = 6.0
    w[FEATURES.index("words_sentence"), 0] = 4.0
    return FeatureModel(
        list(FEATURES),
        np.zeros(len(FEATURES), dtype=np.float32),
        np.ones(len(FEATURES), dtype=np.float32),
        [(w, np.array([-4.0], dtype=np.float32))],
        threshold,
    )


@pytest.mark.parametrize(
    ("question", "kind"),
    [
        ("How many threads does it start?", "how_many"),
        ("How do I stop it?", "how"),
        ("Why is the queue lost?", "why"),
        ("Which file holds the journal?", "which"),
        ("Does it keep the queue on disk?", "yes_no"),
        ("Its default port?", "default"),
        ("Wie viele Threads?", "other"),
    ],
)
def test_question_kind_from_its_first_words(question: str, kind: str) -> None:
    assert Asked.parse(question).opening == kind


def test_features_of_real_candidates() -> None:
    cs = chunks()
    candidates = answer_candidates(cs)
    question = "How many worker threads does the brellow daemon start?"
    x = asyncio.run(candidate_features(Asked.parse(question), cs, candidates, by_embedding(bag_of_words)))
    assert x.shape == (len(candidates), len(FEATURES))
    col = {name: x[:, i] for i, name in enumerate(FEATURES)}
    answer = next(i for i, c in enumerate(candidates) if "six worker" in c.text)
    assert col["cos_sentence"].argmax() == answer and col["cos_sentence_gap"][answer] == 0.0
    assert col["words_sentence"].argmax() == answer
    assert col["has_number"][answer] == 0.0  # "six" is a word, not a number
    assert col["kind_how_many"].tolist() == [1.0] * len(candidates)
    assert col["source_rank"][answer] == 1.0 and col["top_source"][answer] == 1.0
    notes = next(i for i, c in enumerate(candidates) if c.source == 2)
    assert col["source_rank"][notes] == 0.5 and col["hybrid_share"][notes] == pytest.approx(1 / 3)
    assert col["cos_context"][answer] > 0.0 and col["words_context"][answer] > 0.0


def test_word_overlap_reads_any_alphabet() -> None:
    cs = [Chunk("c", "d", "Die Größe des Puffers beträgt 4096 Bytes. Der Dienst läuft im Hintergrund.")]
    candidates = answer_candidates(cs)
    x = asyncio.run(
        candidate_features(
            Asked.parse("Wie groß ist die Größe des Puffers?"), cs, candidates, by_embedding(bag_of_words)
        )
    )
    words = x[:, FEATURES.index("words_sentence")]
    assert words[0] > 0.0 == words[1]  # "Größe", "des", "Puffers" held; none in the second


def test_the_model_orders_and_the_rules_say_whether_anything_answers() -> None:
    cs = chunks()
    scorer = FeatureScorer(model(), by_embedding(bag_of_words))
    found = asyncio.run(read("Where does the brellow daemon keep its queue?", cs, scorer))
    assert found.found and found.best is not None and "queue in memory" in found.best.text
    off_topic = asyncio.run(read("What colour are the ferry tickets in winter?", cs, scorer))
    assert not off_topic.found
    # a count asked for and no numeral in any source: the rules' verdict is "not found", though
    # the model rates the sentence that spells the count out highest
    counted = "How many worker threads does the brellow daemon start?"
    assert not asyncio.run(read(counted, cs, scorer)).found
    by_probability = asyncio.run(
        read(counted, cs, FeatureScorer(model(), by_embedding(bag_of_words), threshold=0.5))
    )
    assert by_probability.found and by_probability.best is not None
    assert "six worker threads" in by_probability.best.text
    strict = FeatureScorer(model(), by_embedding(bag_of_words), threshold=0.999)
    assert not asyncio.run(read(counted, cs, strict)).found


def test_the_model_round_trips_through_json_and_refuses_another_feature_list() -> None:
    m = model(0.3)
    again = FeatureModel.from_json(m.to_json())
    x = np.random.default_rng(0).normal(size=(5, len(FEATURES))).astype(np.float32)
    assert np.allclose(again.probabilities(x), m.probabilities(x)) and again.threshold == 0.3
    renamed = {**m.to_json(), "features": ["cos", *FEATURES[1:]]}
    with pytest.raises(FeatureModelError, match="retrain it"):
        FeatureModel.from_json(renamed)
    narrow = {**m.to_json(), "layers": [{"weights": [[1.0]], "bias": [0.0]}]}
    with pytest.raises(FeatureModelError, match="do not chain"):
        FeatureModel.from_json(narrow)
    with pytest.raises(FeatureModelError, match="not a feature reader"):
        FeatureModel.from_json({"features": list(FEATURES)})
