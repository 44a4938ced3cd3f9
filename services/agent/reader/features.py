"""The learned scorer: signals the product already computes, combined by a model the trainer fits.

Each candidate sentence is described by a fixed list of numbers (``FEATURES``): the collection's
embedder's cosine of the question to the sentence and to its heading path (one embedder call
for the question, the sentences and their few heading paths: the rules' call and a handful more
texts; the question's cosine to the whole chunk is retrieval's dense score); the fallback rules' own score and verdicts (``rules.py``); the IDF-weighted
share of the question's words in the sentence, its heading path and its chunk; its chunk's
retrieval rank and scores; its place in the chunk; its length; and whether it holds a number, a
"default" or a negation, crossed with the question's kind told from its first words. Words are
``\\w`` tokens compared by their first letters (``question.prefixes``), so the lexical signals
read any language written with spaces; the kind of question and the three sentence marks are
English words. The question is read as ``question.Asked`` parsed it, once per scoring.

A trainer ``reader`` job with ``"reader_kind": "features"`` fits the model (a logistic
regression, or a small MLP, on standardised features; services/trainer/recipes/reader_features.py)
on rows built by ``python -m benchmarks.answers.reader_eval rows`` (the tuning sets' candidates,
labelled by the judge). Its artifact, ``feature_reader.json``, holds the feature names, the
standardisation, the weights, and the "not found" threshold on the best candidate's probability.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.agent.chunks import Chunk
from services.agent.reader.question import OPENING_KINDS, Asked, parsed, prefixes
from services.agent.reader.rules import missing_names, rule_answers, verdicts
from services.agent.reader.rules import score as rule_score
from services.agent.reader.scorer import Scored
from services.agent.reader.similarity import Similarity
from services.common.candidates import Candidate

ARTIFACT = "feature_reader.json"

_WORD = re.compile(r"\w+")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,:]\d+)*(?!\w)")
_DEFAULT = re.compile(r"\bdefaults?\b|\bby default\b", re.IGNORECASE)
_NEGATION = re.compile(r"\b(?:not|no|never|cannot|none|neither|nor)\b|n't\b", re.IGNORECASE)

# The question's kind, from its first words (one of them, in this order; "other" when none):
# ``Asked.opening``.
KINDS = OPENING_KINDS

FEATURES = (
    "cos_sentence",
    "cos_context",
    "cos_sentence_gap",  # to the best sentence's cosine among the candidates
    "cos_context_gap",
    "cos_best",  # the question's: the best sentence's cosine
    "rules_score",
    "rules_score_gap",
    "rules_answers",
    "rules_missing",  # the question names something no source holds
    "words_sentence",
    "words_context",
    "words_chunk",
    "words_sentence_gap",
    "source_rank",  # 1 / the chunk's rank
    "top_source",
    "dense_score",
    "hybrid_share",  # the chunk's hybrid score over the top chunk's
    "position",  # 1 / (1 + its place among the chunk's sentences)
    "length",  # log of its words
    "has_number",
    "has_default",
    "has_negation",
    *(f"kind_{k}" for k in KINDS),
    "number_x_how_many",
    "number_x_when",
    "default_x_default",
    "negation_x_yes_no",
)


def _share(asked: dict[str, float], text: str) -> float:
    """The IDF-weighted share of the question's words that ``text`` holds."""
    total = sum(asked.values())
    if not total:
        return 0.0
    held = set(prefixes(text))
    return sum(w for t, w in asked.items() if t in held) / total


def _asked_words(asked: Asked, chunks: list[Chunk]) -> dict[str, float]:
    """The question's words, each weighted by its inverse document frequency among the chunks
    (a word every source holds tells nothing)."""
    docs = [set(prefixes(c.text + " " + c.section + " " + c.title)) for c in chunks]
    n = max(len(docs), 1)
    return {t: math.log((n + 1) / (1 + sum(t in d for d in docs))) + 0.1 for t in asked.word_prefixes}


async def candidate_features(
    asked: Asked, chunks: list[Chunk], candidates: list[Candidate], similarity: Similarity
) -> np.ndarray:
    """One row of ``FEATURES`` per candidate (``candidates``' scores are the rules' afterwards)."""
    if not candidates:
        return np.zeros((0, len(FEATURES)), dtype=np.float32)
    n = len(candidates)
    # the heading paths once each: a question's candidates share a few
    contexts = sorted({c.context for c in candidates if c.context})
    texts = [c.text for c in candidates] + contexts
    cos = np.asarray(await similarity(asked.embedded, texts), dtype=np.float32)
    if cos.shape != (len(texts),):
        raise ValueError(f"{cos.shape[0]} similarities for {len(texts)} texts")
    cos_sentence = cos[:n]
    of_context = dict(zip(contexts, cos[n:].tolist(), strict=True))
    cos_context = np.array([of_context.get(c.context, 0.0) for c in candidates], dtype=np.float32)
    rule_score(asked, chunks, candidates, [float(s) for s in cos_sentence])
    missing = bool(missing_names(asked, chunks))
    rules_scores = np.array([c.score for c in candidates], dtype=np.float32)
    weights = _asked_words(asked, chunks)
    words_sentence = np.array([_share(weights, c.text) for c in candidates], dtype=np.float32)
    top_hybrid = max((abs(c.score) for c in chunks), default=0.0) or 1.0
    kind = asked.opening
    rows = []
    for k, c in enumerate(candidates):
        chunk = chunks[c.source - 1]
        number = bool(_NUMBER.search(c.text))
        default = bool(_DEFAULT.search(c.text))
        negation = bool(_NEGATION.search(c.text))
        values = {
            "cos_sentence": cos_sentence[k],
            "cos_context": cos_context[k],
            "cos_sentence_gap": cos_sentence[k] - cos_sentence.max(),
            "cos_context_gap": cos_context[k] - cos_context.max(),
            "cos_best": cos_sentence.max(),
            "rules_score": rules_scores[k],
            "rules_score_gap": rules_scores[k] - rules_scores.max(),
            "rules_answers": float(not missing and rule_answers(c, True)),
            "rules_missing": float(missing),
            "words_sentence": words_sentence[k],
            "words_context": _share(weights, c.context),
            "words_chunk": _share(weights, chunk.text),
            "words_sentence_gap": words_sentence[k] - words_sentence.max(),
            "source_rank": 1.0 / c.source,
            "top_source": float(c.source == 1),
            "dense_score": float(chunk.scores.get("dense", 0.0)),
            "hybrid_share": chunk.score / top_hybrid,
            "position": 1.0 / (1 + c.position),
            "length": math.log(1 + len(_WORD.findall(c.text))),
            "has_number": float(number),
            "has_default": float(default),
            "has_negation": float(negation),
            **{f"kind_{x}": float(kind == x) for x in KINDS},
            "number_x_how_many": float(number and kind == "how_many"),
            "number_x_when": float(number and kind == "when"),
            "default_x_default": float(default and kind == "default"),
            "negation_x_yes_no": float(negation and kind == "yes_no"),
        }
        rows.append([float(values[name]) for name in FEATURES])
    return np.asarray(rows, dtype=np.float32)


class FeatureModelError(ValueError):
    pass


@dataclass
class FeatureModel:
    """A fitted model: standardised features -> (hidden layer, ReLU) -> one logit."""

    features: list[str]
    mean: np.ndarray
    scale: np.ndarray
    layers: list[tuple[np.ndarray, np.ndarray]]  # (weights [in, out], bias [out]) each
    threshold: float  # a sentence answers when its probability is at least this
    margin: float = 0.05  # a second sentence of the best one's section joins within this

    def probabilities(self, x: np.ndarray) -> np.ndarray:
        h = (np.asarray(x, dtype=np.float32) - self.mean) / self.scale
        for i, (w, b) in enumerate(self.layers):
            h = h @ w + b
            if i < len(self.layers) - 1:
                h = np.maximum(h, 0.0)
        return 1.0 / (1.0 + np.exp(-h[:, 0]))

    def to_json(self) -> dict[str, Any]:
        return {
            "features": self.features,
            "mean": self.mean.tolist(),
            "scale": self.scale.tolist(),
            "layers": [{"weights": w.tolist(), "bias": b.tolist()} for w, b in self.layers],
            "threshold": self.threshold,
            "margin": self.margin,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FeatureModel:
        try:
            names = [str(n) for n in data["features"]]
            model = cls(
                names,
                np.asarray(data["mean"], dtype=np.float32),
                np.asarray(data["scale"], dtype=np.float32),
                [
                    (np.asarray(x["weights"], dtype=np.float32), np.asarray(x["bias"], dtype=np.float32))
                    for x in data["layers"]
                ],
                float(data["threshold"]),
                float(data.get("margin", 0.05)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise FeatureModelError(f"not a feature reader: {exc}") from None
        if names != list(FEATURES):
            raise FeatureModelError(
                f"the model reads features {names[:3]}...; this version computes {list(FEATURES)[:3]}... "
                "(retrain it)"
            )
        width = len(names)
        for w, b in model.layers:
            if w.ndim != 2 or w.shape[0] != width or b.shape != (w.shape[1],):
                raise FeatureModelError(f"layer shapes {w.shape} / {b.shape} do not chain from {width}")
            width = w.shape[1]
        if width != 1 or model.mean.shape != (len(names),) or model.scale.shape != (len(names),):
            raise FeatureModelError("the model must end in one logit over its features")
        return model

    @classmethod
    def load(cls, path: Path) -> FeatureModel:
        file = path / ARTIFACT if path.is_dir() else path
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise FeatureModelError(f"{file}: {exc}") from None
        return cls.from_json(data)


# The model the agent ships (a few kilobytes of JSON): regenerated by
# ``python -m benchmarks.answers.reader_eval rows`` then ``learn --out`` this file
# (benchmarks/answers/README.md), with the trainer's features reader on the tuning question
# sets' candidates. Shipped because the sets' documents are fetched by the benchmark, not by
# the product: a stack could not rebuild it from what it holds.
SHIPPED = Path(__file__).with_name("feature_reader.json")
# The reader name (TANDEM_AGENT_READER, a pipeline's ``reader``) that picks it.
FEATURES_READER = "features"


@functools.cache
def shipped_model() -> FeatureModel:
    return FeatureModel.load(SHIPPED)


class FeatureScorer:
    """The learned scorer over the collection's embedder's similarities (``similarity``).

    The model orders the candidates; whether any answers is the rules' verdict (some candidate
    answers by ``rules.verdicts``), unless a ``threshold`` on the model's probability is given.
    Measured on the held-out sets, the model's ordering states more answers than the rules'
    (benchmarks/RESULTS.md), while one probability threshold said "not found" to far more
    answerable questions than the rules' verdicts do: each set's probabilities sit on their own
    scale."""

    name = "features"

    def __init__(
        self, model: FeatureModel, similarity: Similarity, *, threshold: float | None = None
    ) -> None:
        self.model = model
        self.similarity = similarity
        self.threshold = threshold

    async def score(self, question: str | Asked, chunks: list[Chunk], candidates: list[Candidate]) -> Scored:
        asked = parsed(question)
        x = await candidate_features(asked, chunks, candidates, self.similarity)
        # the candidates carry the rules' scores until the model's replace them
        found = any(verdicts(asked, candidates, True, bool(missing_names(asked, chunks))))
        scores = [float(p) for p in self.model.probabilities(x)] if len(x) else []
        for c, s in zip(candidates, scores, strict=True):
            c.score = s
        if self.threshold is not None:
            return Scored(scores, [s >= self.threshold for s in scores], self.name, self.model.margin)
        return Scored(scores, [found] * len(scores), self.name, self.model.margin)
