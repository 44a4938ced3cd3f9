"""How an extractive answer reads: what kind of thing the question asks for, and the answer in
that form ("The default is 8080.", "Yes." or "No." before the sentence that decides it).

The question is parsed once (``Asked``) by its opening words. These are English forms: for
another language the answer is the cited sentences alone, as it is for kinds with no form.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

QuestionKind = Literal["how", "why", "default", "yesno", "howmany", "when", "which", "what", "other"]

_KINDS: list[tuple[QuestionKind, re.Pattern[str]]] = [
    ("default", re.compile(r"\bdefaults?\b", re.IGNORECASE)),
    (
        "howmany",
        re.compile(r"^\s*(?:how (?:many|much|long|often|large|big|far|old)|what (?:number|size))\b", re.I),
    ),
    ("why", re.compile(r"^\s*why\b", re.IGNORECASE)),
    ("when", re.compile(r"^\s*(?:when|under what (?:conditions?|circumstances?))\b", re.IGNORECASE)),
    ("how", re.compile(r"^\s*(?:how|in what way)\b", re.IGNORECASE)),
    ("which", re.compile(r"^\s*(?:which|who|where)\b", re.IGNORECASE)),
    ("what", re.compile(r"^\s*what\b", re.IGNORECASE)),
    (
        "yesno",
        re.compile(
            r"^\s*(?:is|are|was|were|can|could|does|do|did|should|will|would|must|may|has|have|had|"
            r"isn't|aren't|doesn't|don't|can't)\b",
            re.IGNORECASE,
        ),
    ),
]
# Words that turn a statement into its opposite.
_NEGATION = re.compile(
    r"\b(?:not|no|never|cannot|none|neither|nor|without|unable)\b|n't\b|\bonly\b.*\bnot\b", re.IGNORECASE
)
# "The default is 8080", "defaults to the current directory", "(default: 5s)", "Default value: on".
_DEFAULT = re.compile(
    r"\bdefaults?(?:\s+(?:value|setting|is|was))?\s*(?:is|are|to|:|=|of)\s*(?:set to\s+)?"
    r"(?P<value>[^.;,()\n]{1,60}?)\s*(?:[.;,()\n]|$)",
    re.IGNORECASE,
)
_VALUE_WORDS = 8


@dataclass(frozen=True)
class Asked:
    """A question as the answer step reads it, parsed once."""

    text: str
    kind: QuestionKind

    @classmethod
    def parse(cls, question: str) -> Asked:
        text = question.strip()
        for kind, pattern in _KINDS:
            if pattern.search(text):
                return cls(text, kind)
        return cls(text, "other")


def _negated(text: str) -> bool:
    return _NEGATION.search(text) is not None


def yes_or_no(asked: Asked, sentence: str) -> str | None:
    """ "Yes" or "No" for a yes/no question whose answering sentence decides it: "No" when the
    sentence negates what the question asks (or affirms what a negative question denies). It
    reads polarity by negation words alone: a sentence that answers "without X?" with "cannot
    ... unless X" reads as agreeing; the cited sentence follows, so a reader can tell."""
    if asked.kind != "yesno":
        return None
    return "No" if _negated(sentence) != _negated(asked.text) else "Yes"


def default_value(asked: Asked, sentence: str) -> str | None:
    """The value a sentence gives as the default ("8080" of "The default port is 8080."), when
    the question asks for a default."""
    if asked.kind != "default":
        return None
    match = _DEFAULT.search(sentence)
    if match is None:
        return None
    value = match.group("value").strip().strip("`\"'“”")
    if not value or len(value.split()) > _VALUE_WORDS:
        return None
    return value


def lead(asked: Asked, sentences: list[str]) -> str:
    """What an extractive answer opens with before its cited sentences ("" for none)."""
    for sentence in sentences:
        value = default_value(asked, sentence)
        if value is not None:
            return f"The default is {value}."
    if sentences:
        verdict = yes_or_no(asked, sentences[0])
        if verdict is not None:
            return f"{verdict}."
    return ""
