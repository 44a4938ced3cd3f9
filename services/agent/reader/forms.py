"""How an extractive answer reads: what kind of thing the question asks for, and the answer in
that form ("The default is 8080.", "Yes." or "No." before the sentence that decides it).

It reads the question as parsed once (``question.Asked``): its kind, by its opening words, and
whether it holds a negation. These are English forms: for another language the answer is the
cited sentences alone, as it is for kinds with no form.
"""

from __future__ import annotations

import re

from services.agent.reader.question import NEGATION, Asked

# "The default is 8080", "defaults to the current directory", "(default: 5s)", "Default value: on".
_DEFAULT = re.compile(
    r"\bdefaults?(?:\s+(?:value|setting|is|was))?\s*(?:is|are|to|:|=|of)\s*(?:set to\s+)?"
    r"(?P<value>[^.;,()\n]{1,60}?)\s*(?:[.;,()\n]|$)",
    re.IGNORECASE,
)
_VALUE_WORDS = 8


def _negated(text: str) -> bool:
    return NEGATION.search(text) is not None


def yes_or_no(asked: Asked, sentence: str) -> str | None:
    """ "Yes" or "No" for a yes/no question whose answering sentence decides it: "No" when the
    sentence negates what the question asks (or affirms what a negative question denies). It
    reads polarity by negation words alone: a sentence that answers "without X?" with "cannot
    ... unless X" reads as agreeing; the cited sentence follows, so a reader can tell."""
    if asked.kind != "yesno":
        return None
    return "No" if _negated(sentence) != asked.negated else "Yes"


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
