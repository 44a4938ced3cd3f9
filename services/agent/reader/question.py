"""The question as the answer step reads it: parsed once (``Asked.parse``) into typed fields.

Every regular expression and word list that reads the question lives here: its kind (by its
opening words, for the answer's form, and as the learned scorer's feature), its content terms
and their stems, what kind of thing it asks for (a month, a year, a number, a size, a person's
name, a term written as a manual writes one, the kind nouns of a "which X", the asked verb) and
its names. The scorers and the rules (``rules``, ``features``, ``scorer``) read these fields for
every candidate sentence instead of parsing the question again; ``read`` (the package's entry
point) parses it at the top. The patterns that read sentences stay with the rules, except those
that read the question too (a constant, a version, a name's token, a negation).

These are English forms and rules: a question in another language has kind "other" and asks for
no kind of thing; its content terms and names still count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from services.agent.grounding import FILLER, names, strip_markers
from services.common.text import STOPWORDS, content_terms, sentences, stem

# -- the kind, by the opening words --------------------------------------------------------------

# The answer's form (services/agent/reader/forms.py): "The default is 8080.", "Yes."
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

# The learned scorer's kind (services/agent/reader/features.py, its ``kind_*`` features): from
# the first word alone, "how_many" for "how many / how much", "default" for one naming a default.
OpeningKind = Literal["how_many", "how", "why", "what", "which", "when", "yes_no", "default", "other"]
# in this order: the learned scorer's ``kind_*`` features
OPENING_KINDS: tuple[OpeningKind, ...] = get_args(OpeningKind)
_YES_NO = frozenset(
    [
        "is",
        "are",
        "was",
        "were",
        "does",
        "do",
        "did",
        "can",
        "could",
        "should",
        "will",
        "would",
        "may",
        "must",
        "has",
        "have",
    ]
)
_FIRST_WORDS: dict[str, OpeningKind] = {
    "how": "how",
    "why": "why",
    "what": "what",
    "which": "which",
    "when": "when",
}
# Letters two words must share at their start to count as one word ("configure" / "configured"):
# the learned scorer's stemmer for no language in particular.
PREFIX = 5
_WORD = re.compile(r"\w+")

# Words that turn a statement into its opposite (a question's and its answering sentence's).
NEGATION = re.compile(
    r"\b(?:not|no|never|cannot|none|neither|nor|without|unable)\b|n't\b|\bonly\b.*\bnot\b", re.IGNORECASE
)

# -- what kind of thing it asks for ----------------------------------------------------------------

# A named constant as a manual writes one: "QUOR_TRACE", "QUOR_BUF_SHORT" (not "-D__X").
CONSTANT = re.compile(r"(?<![\w-])[A-Z][A-Z0-9]*_[A-Z0-9_]+\b")
# "When ...?" asks for a time; "When compiling stops on X, which package ...?" is a condition.
_WHEN_Q = r"^\s*when\b(?![^?]*,\s*(?:which|what|how|who|whom|where|why|is|are|does|do|can|should)\b)"
# "When ...?" is not here: it asks for a time or for a condition ("when the cache is full"),
# and a condition holds no number (measured on the tuning sets: RESULTS, "thirteen sets").
_NUMBER_Q = re.compile(
    r"\bhow (many|much|deep|high|tall|long|old|far|big|large|wide|heavy)\b"
    r"|\b(what|which)( \w+){0,3} (year|date|number|version)\b|\bnumeric\b"
)
# "How long may a key name be?": a manual may answer with a named constant
# ("at most QUOR_MAX_KEY_LEN").
_SIZE_Q = re.compile(r"\bhow (many|much|large|big|long)\b")
# A year or a date: "in which year", "on which date", answered by a year or a month.
_YEAR_Q = re.compile(r"\b(what|which) (year|date)\b")
# "When was it released?" asks for a time; "what does it return when ...?" does not.
_MONTH_Q = re.compile(rf"\b(which|what) month\b|{_WHEN_Q}")
_WHO_Q = re.compile(r"^\s*(who|whom|whose)\b")
_LETTERS = re.compile(r"[A-Za-z]+")

# "Which option ...", "what environment variable ...", "which function ...", "which header file
# ...": the asked kind of term, by the noun after the question word, and how a manual writes one.
TermKind = Literal["option", "constant", "function", "file", "returned"]
_ASKED = "|".join(["which", "what", "the"])
_TERM_KINDS: list[tuple[TermKind, re.Pattern[str]]] = [
    ("option", re.compile(rf"\b(?:{_ASKED})\s+(?:\w+\s+){{0,2}}?(?:option|flag|switch|argument)s?\b")),
    (
        "constant",
        re.compile(rf"\b(?:{_ASKED})\s+(?:\w+\s+){{0,2}}?(?:variable|constant|macro|error|code|value)s?\b"),
    ),
    ("function", re.compile(rf"\b(?:{_ASKED})\s+(?:\w+\s+){{0,2}}?(?:function|method|call|routine)s?\b")),
    ("file", re.compile(rf"\b(?:{_ASKED})\s+(?:\w+\s+){{0,2}}?(?:file|header|library)s?\b")),
    # "What does quor_get_entry return when ...?": a constant, a number, NULL
    ("returned", re.compile(r"\bwhat\b.*\breturns?\b|\bwhat\b.*\bset to\b")),
]
# How a manual writes a term of each kind: the rules look for one in a sentence, and a term the
# question itself writes is no answer.
WRITTEN: dict[TermKind, re.Pattern[str]] = {
    "option": re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*(?:=\S+)?"),
    "constant": CONSTANT,
    "function": re.compile(r"\b[A-Za-z]\w*_\w+\b|\b\w+\(\)"),
    "file": re.compile(
        r"\b[\w.-]+\.(?:h|c|so|a|py|md|json|toml|ya?ml|txt|html?|pdf|conf|cfg|ini|sh|db|sqlite3)\b"
    ),
    "returned": re.compile(rf"{CONSTANT.pattern}|(?<![\w.-])-1\b|\bNULL\b|\b(?:true|false)\b"),
}

# "Which program receives ...", "Which Ferrule mode is the default mode?", "which package is
# required": the words after "which" (up to a stopword, at most three) name the kind of thing asked
# for; a manual names one beside the kind's own word ("the ferrule-collector program", "use the
# Mirror mode", "install the quorzip-devel package", "Ledger is the only mode").
_WHICH = re.compile(r"\bwhich\s+((?:[\w.'-]+\s+){1,3})", re.IGNORECASE)
# A token as a manual writes a name: inline code, or a word with a capital after its first letter
# place, a digit, "-", "_", "." or "/" inside it.
TOKEN = re.compile(r"`[^`]+`|[A-Za-z0-9][\w.+/-]*[\w+]|[A-Za-z]")

# "What does Taisbrith Works make?": the sentence that answers holds the asked verb ("makes").
_VERB_Q = re.compile(r"^\s*what (?:does|do|did) .+ (\w+)\s*\?\s*$")

# -- the words naming the answer's kind ------------------------------------------------------------

# "Which spreadsheet tracks ...", "What is the fax number of ...", "What archive format does ...":
# the words after "which" / "what (is the)" name the kind of thing asked for. Sources that never name
# that kind cannot say which one it is.
_ASKED_KIND = re.compile(
    r"\b(?:which|what)\s+(?:(?:is|are|was|were)\s+(?:the|a|an)\s+)?((?:[\w.'-]+\s+){1,4})",
    re.IGNORECASE,
)
# words that name no kind of their own ("what kind of", "which one"); kinds a source states by an
# instance, not by name ("9 March 2021" answers "which date", "$5" "what price"); and the kinds
# a manual writes as terms (`--snapshot=all` answers "which option", `quillon serve --workers 2`
# "which command")
_GENERIC_KINDS = frozenset(
    [
        *("kind", "sort", "type", "one", "ones", "thing", "things", "way", "part", "value", "values"),
        *("date", "dates", "year", "years", "month", "day", "time", "times", "number", "numbers"),
        *("version", "versions", "size", "amount", "price", "cost", "name", "names", "count", "length"),
        *("duration", "percentage", "ratio"),
        *("option", "options", "command", "commands", "function", "functions", "file", "files"),
        *("variable", "variables", "flag", "flags", "program", "programs", "package", "packages"),
        *("tool", "tools", "setting", "settings", "macro", "constant", "header", "argument"),
        *("parameter", "field", "key", "library", "module", "class", "method", "error", "code"),
    ]
)
# a phrase ended by an article ends on its verb: "Which index holds the ..."
_ARTICLES = frozenset({"the", "a", "an", "this", "that", "these", "those", "its", "their", "his", "her"})
_KIND_WORDS = 3
_MODALS = frozenset({"must", "can", "could", "may", "might", "shall", "should", "will", "would"})

# "3.0", "2.10.0": compared whole ("version 3.0" is not in a text that says "2.10.0" and "0").
VERSION = re.compile(r"(?<![\w.])\d+(?:\.\d+)+(?![\w]|\.\d)")


def prefixes(text: str) -> list[str]:
    """The learned scorer's words of ``text``: ``\\w`` tokens, lower-cased, cut to ``PREFIX``."""
    return [w.lower()[:PREFIX] for w in _WORD.findall(text)]


def _kind(text: str) -> QuestionKind:
    for kind, pattern in _KINDS:
        if pattern.search(text):
            return kind
    return "other"


def _opening(question: str) -> OpeningKind:
    words = [w.lower() for w in _WORD.findall(question)]
    first = words[0] if words else ""
    if first == "how" and len(words) > 1 and words[1] in ("many", "much"):
        return "how_many"
    if first in _FIRST_WORDS:
        return _FIRST_WORDS[first]
    if first in _YES_NO:
        return "yes_no"
    if "default" in words or "defaults" in words:
        return "default"
    return "other"


def _kind_nouns(question: str) -> frozenset[str]:
    """The stems of the words a "which ..." question names its kind with."""
    out: set[str] = set()
    for match in _WHICH.finditer(question):
        for word in match.group(1).split():
            w = word.lower().removesuffix("'s")
            if w in STOPWORDS:
                break
            if w.isalpha() and len(w) > 2 and stem(w) not in FILLER:
                out.add(stem(w))
    return frozenset(out)


def _kind_words(question: str) -> frozenset[str]:
    """The words a "which / what" question names its answer's kind with (lower-cased):
    "fax" of "What is the fax number of ...", "archive" and "format" of "What archive format does
    ...". The phrase is the words before the first stopword, at most three, less a last word an
    article follows ("Which index holds the ...": a verb); where no stopword ends it that soon
    ("Which spreadsheet tracks Quillon's ..."), its first word alone ("spreadsheet"): without a
    tagger, a verb cannot be told from a noun. Only plain words count (names and terms are
    compared as names)."""
    out: set[str] = set()
    for match in _ASKED_KIND.finditer(question):
        words = [w.lower().removesuffix("'s") for w in match.group(1).split()]
        ends = next((i for i, w in enumerate(words) if w in STOPWORDS or w in _MODALS), None)
        phrase = words[:ends] if ends is not None and ends <= _KIND_WORDS else words[:1]
        if ends is not None and ends <= _KIND_WORDS and len(phrase) > 1 and words[ends] in _ARTICLES:
            phrase = phrase[:-1]
        out |= {
            w
            for w in phrase
            if w.isalpha() and len(w) > 2 and w not in _GENERIC_KINDS and stem(w) not in FILLER
        }
    return frozenset(out)


@dataclass(frozen=True)
class Asked:
    """A question as the answer step reads it, parsed once (``Asked.parse``)."""

    text: str  # as given (the reader model reads it so)
    kind: QuestionKind  # by its opening words: the answer's form
    opening: OpeningKind  # by its first word: the learned scorer's kind
    negated: bool  # it holds a negation ("Can it run without X?")
    embedded: str  # what the embedder reads: citation markers out, trimmed
    terms: tuple[str, ...]  # its content words, stemmed, in order
    focus: tuple[str, ...]  # ``terms`` less the filler words that name no subject ("use")
    focus_stems: frozenset[str]  # the stems of ``focus`` (stemmed again, as the rules compare them)
    word_prefixes: tuple[str, ...]  # its distinct words as the learned scorer compares them
    names: frozenset[str]  # capitalised words after each sentence's first, numbers (lower-cased)
    kind_words: frozenset[str]  # the plain words naming the answer's kind ("fax" of "fax number")
    versions: tuple[str, ...]  # version numbers, whole ("2.10.0")
    # What kind of thing it asks for: the rules find it in a sentence.
    month: bool  # "which month", "when was ..."
    year: bool  # "which year / date"
    number: bool  # "how many / deep / long", "which version", "numeric"
    size: bool  # "how many / much / large / big / long": a named constant may answer it too
    person: bool  # "who / whom / whose": a name the question lacks
    letters: frozenset[str]  # its words of letters, lower-cased (the names it already holds)
    term_kinds: tuple[TermKind, ...]  # "which option / variable / function / file", "what ... return"
    known_terms: frozenset[str]  # the terms of those kinds it writes itself (lower-cased)
    kind_nouns: frozenset[str]  # the stems of the words naming a "which X"'s X
    tokens: frozenset[str]  # its name-like tokens, lower-cased (``TOKEN``)
    verb: str | None  # "What does X make?": the stem of the asked verb

    @classmethod
    def parse(cls, question: str) -> Asked:
        q = question.lower()
        terms = tuple(content_terms(question))
        focus = tuple(t for t in terms if t not in FILLER)
        term_kinds = tuple(kind for kind, asked in _TERM_KINDS if asked.search(q))
        spoken: set[str] = set()
        for start, end in sentences(question):  # each sentence's first word is not a name
            spoken |= names(question[start:end])
        verb = _VERB_Q.match(q)
        return cls(
            text=question,
            kind=_kind(question.strip()),
            opening=_opening(question),
            negated=NEGATION.search(question) is not None,
            embedded=embedded_text(question),
            terms=terms,
            focus=focus,
            focus_stems=frozenset(stem(t) for t in focus),
            # the order a set of them iterates in: the learned scorer sums weights in it
            word_prefixes=tuple(set(prefixes(question))),
            names=frozenset(spoken),
            kind_words=_kind_words(question),
            versions=tuple(VERSION.findall(question)),
            month=_MONTH_Q.search(q) is not None,
            year=_YEAR_Q.search(q) is not None,
            number=_NUMBER_Q.search(q) is not None,
            size=_SIZE_Q.search(q) is not None,
            person=_WHO_Q.search(q) is not None,
            letters=frozenset(w.lower() for w in _LETTERS.findall(question)),
            term_kinds=term_kinds,
            known_terms=frozenset(t.lower() for kind in term_kinds for t in WRITTEN[kind].findall(question)),
            kind_nouns=_kind_nouns(question),
            tokens=frozenset(w.lower() for w in TOKEN.findall(question)),
            verb=None if verb is None else stem(verb.group(1)),
        )

    @property
    def asks_number(self) -> bool:
        """It asks for a number, a date or a year ("how many", "which year", "which version"): an
        answer without one does not answer it."""
        return self.number or self.year

    @property
    def asks_term(self) -> bool:
        """It asks for an option, a variable, a function, a file or a return value, or names the
        kind of thing it asks for ("which program ...", "which tool ...")."""
        return bool(self.term_kinds) or bool(self.kind_nouns)


def embedded_text(question: str) -> str:
    """What the embedder reads of a question: citation markers out, trimmed."""
    return strip_markers(question).strip()


def parsed(question: str | Asked) -> Asked:
    """``question`` parsed, or as it is when it already is (the entry points take either)."""
    return question if isinstance(question, Asked) else Asked.parse(question)
