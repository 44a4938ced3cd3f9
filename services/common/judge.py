"""The judge of answers: does an answer state the expected fact, and does it decline?

One module for every place that judges answers (``tandem eval rag``, the benchmarks, the
promotion gate, the evaluation sets of services/agent/evals/, which judge whole questions on it), kept apart from the code that writes answers: an answer step that shared its
judge's notion of a word or a sentence could pass its own test without answering.

- ``has_phrase``: a key phrase occurs as whole words (case, typographic quotes and dashes,
  ``_`` against a space and citation markers ignored);
- ``states_reference``: an answer holds ``REFERENCE_RECALL`` of a reference answer's content
  words (stemmed; those the question already names do not count unless they are all there is),
  ``reference_overlap`` the share it holds;
- ``abstains``: the answer declines ("I don't know", "the sources do not say", ...).
"""

from __future__ import annotations

import functools
import re

import Stemmer

_QUOTES = str.maketrans(
    {"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-", "\u2014": "-"}
)
_MARKER = re.compile(r"\[\s*\d{1,3}(?:\s*[,;]\s*\d{1,3})*\s*\]")
# Letters of any script are word characters: "Größe" and "déjà" are words.
_WORD = re.compile(r"[^\W_]+", re.UNICODE)
# Function words a reference answer's content never rests on.
_FUNCTION_WORDS = frozenset(
    [
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "by",
        "can",
        "do",
        "does",
        "for",
        "from",
        "has",
        "have",
        "how",
        "i",
        "if",
        "in",
        "is",
        "it",
        "its",
        "no",
        "not",
        "of",
        "on",
        "or",
        "that",
        "the",
        "their",
        "then",
        "there",
        "these",
        "this",
        "to",
        "was",
        "were",
        "what",
        "when",
        "where",
        "which",
        "who",
        "why",
        "will",
        "with",
        "you",
        "your",
    ]
)
# Share of a reference answer's content words an answer must hold to state it.
REFERENCE_RECALL = 0.6


def flat(text: str) -> str:
    """Lower case, typographic quotes and dashes plain, ``_`` as a space (PDF text often loses
    underscores), citation markers and runs of spaces as one space."""
    text = _MARKER.sub(" ", text.translate(_QUOTES).lower()).replace("_", " ")
    return re.sub(r"\s+", " ", text).strip()


def has_phrase(answer: str, phrase: str) -> bool:
    """``phrase`` occurs in ``answer`` as whole words (``--check`` in "use --check", not "checks")."""
    p = flat(phrase)
    if not p:
        return False
    pattern = (r"(?<![^\W_])" if _WORD.match(p[0]) else "") + re.escape(p)
    pattern += r"(?![^\W_])" if _WORD.match(p[-1]) else ""
    return re.search(pattern, flat(answer)) is not None


@functools.lru_cache(maxsize=1)
def _stemmer() -> Stemmer.Stemmer:
    return Stemmer.Stemmer("english")


def _content(text: str) -> set[str]:
    words = [w for w in _WORD.findall(flat(text)) if w not in _FUNCTION_WORDS and len(w) > 1]
    return set(_stemmer().stemWords(words))


def reference_overlap(answer: str, reference: str, question: str = "") -> float | None:
    """The share of the reference's content words the answer holds (those the question already
    names do not count, unless they are all there is); None when the reference has none."""
    wanted = _content(reference) - _content(question)
    if not wanted:
        wanted = _content(reference)
    return len(wanted & _content(answer)) / len(wanted) if wanted else None


def states_reference(answer: str, reference: str, question: str = "") -> bool:
    """The answer holds at least ``REFERENCE_RECALL`` of the reference's content words."""
    share = reference_overlap(answer, reference, question)
    return share is not None and share >= REFERENCE_RECALL


# "I don't know", "the sources do not say", "no information about", "cannot find": a model's or
# a pipeline's way of declining, read from the text when a response carries no ``answer_kind``.
_ABSTAIN = re.compile(
    r"\b(?:i\s+(?:do\s+not|don'?t|cannot|can'?t)\s+know"
    r"|(?:do(?:es)?\s+not|don'?t|doesn'?t)\s+(?:say|mention|state|contain|provide|specify|answer|include|have)"
    r"|(?:no|not\s+(?:enough|any))\s+(?:relevant\s+)?(?:information|mention|details?|answer|sources?)"
    r"|(?:cannot|can'?t|could\s+not|couldn'?t|unable\s+to)\s+(?:find|answer|determine|tell|say|provide)"
    r"|not\s+(?:mentioned|stated|specified|provided|covered|found)"
    r"|(?:is|are)\s+unknown|unclear\s+from)",
    re.IGNORECASE,
)


def abstains(answer: str, answer_kind: str | None = None) -> bool:
    if answer_kind == "not_found":
        return True
    text = answer.translate(_QUOTES).strip()
    return not text or _ABSTAIN.search(text) is not None
