"""The fallback scorer: the collection's embedder and hand-written English rules.

Used when no reader model is served (``services/agent/reader/scorer.py``), and the baseline the
reader is measured against (benchmarks/answers/reader_eval.py). Each candidate is scored by the
cosine similarity of its embedding to the question's, plus the share of the question's *focus
terms* it holds (its content words that are not in every source), plus small bonuses for a
sentence of the top-ranked section and for one holding the kind of thing asked ("how many": a
number). It answers when similar enough and holding a focus term; a question naming something
no source holds ("Which Kotlin client ...") is answered by none, and one asking for a number only by a
sentence holding one.

These are rules for English text: the reader replaces them wherever it is served.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

import numpy as np

from services.agent.chunks import Chunk
from services.agent.grounding import FILLER, names, strip_markers
from services.agent.reader.candidates import Candidate, balanced, clean, source_sentences
from services.agent.reader.scorer import Scored
from services.agent.reader.select import Selection, places
from services.agent.text import STOPWORDS, WORD_RE, content_terms, is_heading, sentences, stem

# Texts in, one vector per text out (inference's /v1/embeddings with the collection's model).
Embed = Callable[[list[str]], Awaitable[list[list[float]]]]

# Weights and thresholds, measured with all-MiniLM-L6-v2 on the question set of
# tests/agent/data/answer_dev.json (docs/agent.md, "Answers").
FOCUS_WEIGHT = 0.3
SECTION_BONUS = 0.05
# The share of all the question's words a sentence holds, focus terms or not: among sentences of
# one source that all name the question's subject, the one with its verb ("What does Taisbrith
# Works make?": "... makes wooden clocks", not "... employs 689 people").
WORDS_WEIGHT = 0.05
TYPE_BONUS = 0.1
# An answering sentence scores at least MIN_ANSWER_SCORE (similarity + weighted focus share and
# bonuses) and is at least MIN_ANSWER_SIMILARITY similar to the question.
MIN_ANSWER_SCORE = 0.55
MIN_ANSWER_SIMILARITY = 0.3
# A second sentence of the same section joins the answer when it scores within this of the first
# and holds as large a share of the focus terms.
SECOND_MARGIN = 0.08
# Without an embedder (it failed): a candidate must hold this share of the focus terms.
MIN_LEXICAL_FOCUS = 0.5


_MONTHS = [
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
]
# A named constant as a manual writes one: "QUOR_TRACE", "QUOR_BUF_SHORT" (not "-D__X").
_CONSTANT = re.compile(r"(?<![\w-])[A-Z][A-Z0-9]*_[A-Z0-9_]+\b")
# "When ...?" asks for a time; "When compiling stops on X, which package ...?" is a condition.
_WHEN_Q = r"^\s*when\b(?![^?]*,\s*(?:which|what|how|who|whom|where|why|is|are|does|do|can|should)\b)"
# "When ...?" is not here: it asks for a time or for a condition ("when the cache is full"),
# and a condition holds no number (measured on the tuning sets: RESULTS, "thirteen sets").
_NUMBER_Q = re.compile(
    r"\bhow (many|much|deep|high|tall|long|old|far|big|large|wide|heavy)\b"
    r"|\b(what|which)( \w+){0,3} (year|date|number|version)\b|\bnumeric\b"
)
# A number standing alone: "15 s", "3 to 5 times", "2.10.0", not the digit of "X.25" or "md5".
_NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,:]\d+)*(?!\w)")
# "How long may a key name be?": a manual may answer with a named constant
# ("at most QUOR_MAX_KEY_LEN").
_SIZE_Q = re.compile(r"\bhow (many|much|large|big|long)\b")
# A year or a date: "in which year", "on which date", answered by a year or a month.
_YEAR_Q = re.compile(r"\b(what|which) (year|date)\b")
# "When was it released?" asks for a time; "what does it return when ...?" does not.
_MONTH_Q = re.compile(rf"\b(which|what) month\b|{_WHEN_Q}")
_WHO_Q = re.compile(r"^\s*(who|whom|whose)\b")


# "Which option ...", "what environment variable ...", "which function ...", "which header file
# ...": the asked kind of thing, by the noun after the question word, and how a manual writes one.
_ASKED = "|".join(["which", "what", "the"])
_TERM_KINDS: list[tuple[re.Pattern[str], re.Pattern[str]]] = [
    (
        re.compile(rf"\b(?:{_ASKED})\s+(?:\w+\s+){{0,2}}?(?:option|flag|switch|argument)s?\b"),
        re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*(?:=\S+)?"),
    ),
    (
        re.compile(rf"\b(?:{_ASKED})\s+(?:\w+\s+){{0,2}}?(?:variable|constant|macro|error|code|value)s?\b"),
        _CONSTANT,
    ),
    (
        re.compile(rf"\b(?:{_ASKED})\s+(?:\w+\s+){{0,2}}?(?:function|method|call|routine)s?\b"),
        re.compile(r"\b[A-Za-z]\w*_\w+\b|\b\w+\(\)"),
    ),
    (
        re.compile(rf"\b(?:{_ASKED})\s+(?:\w+\s+){{0,2}}?(?:file|header|library)s?\b"),
        re.compile(
            r"\b[\w.-]+\.(?:h|c|so|a|py|md|json|toml|ya?ml|txt|html?|pdf|conf|cfg|ini|sh|db|sqlite3)\b"
        ),
    ),
    (
        # "What does quor_get_entry return when ...?": a constant, a number, NULL
        re.compile(r"\bwhat\b.*\breturns?\b|\bwhat\b.*\bset to\b"),
        re.compile(rf"{_CONSTANT.pattern}|(?<![\w.-])-1\b|\bNULL\b|\b(?:true|false)\b"),
    ),
]


def asks_term(question: str) -> bool:
    """Whether ``question`` asks for an option, a variable, a function, a file or a return value,
    or names the kind of thing it asks for ("which program ...", "which tool ...")."""
    q = question.lower()
    return any(asked.search(q) for asked, _term in _TERM_KINDS) or bool(_kind_nouns(question))


# "Which program receives ...", "Which Ferrule mode is the default mode?", "which package is
# required": the words after "which" (up to a stopword, at most three) name the kind of thing asked
# for; a manual names one beside the kind's own word ("the ferrule-collector program", "use the
# Mirror mode", "install the quorzip-devel package", "Ledger is the only mode").
_WHICH = re.compile(r"\bwhich\s+((?:[\w.'-]+\s+){1,3})", re.IGNORECASE)
# A token as a manual writes a name: inline code, or a word with a capital after its first letter
# place, a digit, "-", "_", "." or "/" inside it.
_TOKEN = re.compile(r"`[^`]+`|[A-Za-z0-9][\w.+/-]*[\w+]|[A-Za-z]")
# how far before (a subject: "Ledger is the only mode") and after ("variable QUOR_TRACE")
# the kind's word an instance may stand
_INSTANCE_BEFORE = 4
_INSTANCE_AFTER = 2


def _kind_nouns(question: str) -> set[str]:
    """The stems of the words a "which ..." question names its kind with."""
    out: set[str] = set()
    for match in _WHICH.finditer(question):
        for word in match.group(1).split():
            w = word.lower().removesuffix("'s")
            if w in STOPWORDS:
                break
            if w.isalpha() and len(w) > 2 and stem(w) not in FILLER:
                out.add(stem(w))
    return out


def _name_like(token: str, first: bool) -> bool:
    if token.startswith("`"):
        return True
    body = token if not first else token[1:]
    return any(ch.isupper() or ch.isdigit() or ch in "-_./" for ch in body)


def names_instance(question: str, sentence: str) -> bool:
    """Whether ``sentence`` names a thing of the kind a "which ..." question asks for: a name the
    question lacks within a few words of the kind's word."""
    kinds = _kind_nouns(question)
    if not kinds:
        return False
    known = {w.lower() for w in _TOKEN.findall(question)}
    tokens = _TOKEN.findall(sentence)
    for i, token in enumerate(tokens):
        if stem(token.lower()) not in kinds:
            continue
        near = range(max(0, i - _INSTANCE_BEFORE), min(len(tokens), i + _INSTANCE_AFTER + 1))
        for k in near:
            other = tokens[k]
            plain = other.strip("`").lower()
            if k == i or plain in known or plain in STOPWORDS or stem(plain.lstrip("-")) in kinds:
                continue  # "--mode" is the kind's own word, not a mode
            if _name_like(other, first=k == 0):
                return True
    return False


def asked_terms(question: str, sentence: str) -> list[str] | None:
    """The terms of the kind ``question`` asks for ("which option": ``--deep-scan``; "which
    variable": ``QUOR_TRACE``; "which function": ``quor_clone_tree``; "which file": ``libquor.h``)
    that ``sentence`` holds and the question does not; None when it asks for no such kind."""
    q = question.lower()
    kinds = [term for asked, term in _TERM_KINDS if asked.search(q)]
    if not kinds:
        return None
    known = {t.lower() for term in kinds for t in term.findall(question)}
    return [t for term in kinds for t in term.findall(sentence) if t.lower() not in known]


# "What does Taisbrith Works make?": the sentence that answers holds the asked verb ("makes").
_VERB_Q = re.compile(r"^\s*what (?:does|do|did) .+ (\w+)\s*\?\s*$")


def _names_month(sentence: str) -> bool:
    """A month's name, capitalised as a date writes it ("May 2024", not "you may")."""
    return any(w.lower() in _MONTHS for w in re.findall(r"\b[A-Z][a-z]+\b", sentence))


def asks_number(question: str) -> bool:
    """Whether ``question`` asks for a number, a date or a year ("how many", "which year",
    "which version"): an answer without one does not answer it."""
    q = question.lower()
    return bool(_NUMBER_Q.search(q) or _YEAR_Q.search(q))


def answer_type_match(question: str, sentence: str) -> bool:
    """Whether ``sentence`` holds the kind of thing ``question`` asks for: a number for "how deep",
    a month for "which month", a name (a capitalised word the question lacks) for "who", a term
    written as a manual writes one for "which option / variable / function / file"."""
    q = question.lower()
    if _MONTH_Q.search(q) and _names_month(sentence):
        return True
    if _YEAR_Q.search(q):
        return bool(re.search(r"\b(1[5-9]|20)\d\d\b", sentence)) or _names_month(sentence)
    if _NUMBER_Q.search(q):
        return bool(_NUMBER.search(sentence) or (_SIZE_Q.search(q) and _CONSTANT.search(sentence)))
    if _WHO_Q.search(q):
        asked = {w.lower() for w in re.findall(r"[A-Za-z]+", question)}
        words = re.findall(r"[A-Za-z]+", sentence)[1:]  # the first word is capitalised anyway
        return any(w[0].isupper() and w.lower() not in asked for w in words)
    terms = asked_terms(question, sentence)
    if terms is not None:
        return bool(terms)  # a kind with a written form ("--check" for "which option")
    if names_instance(question, sentence):
        return True
    verb = _VERB_Q.match(q)
    if verb is None:
        return False
    return stem(verb.group(1)) in {stem(w) for w in re.findall(r"[a-z]+", sentence.lower())}


def focus_terms(question: str, chunks: list[Chunk]) -> list[str]:
    """The question's content words (filler aside) that are not in every source's body (its
    headings aside: a heading that repeats the question says nothing about where the answer is)."""
    terms = [t for t in content_terms(question) if t not in FILLER]
    if len(chunks) < 2:
        return terms
    vocab = [_stems(" ".join(s for s in source_sentences(c) if not is_heading(s))) for c in chunks]
    focus = [t for t in terms if not all(t in v for v in vocab)]
    return focus or terms


def _stems(text: str) -> set[str]:
    return {stem(w) for w in WORD_RE.findall(text)}


def focus_share(focus: list[str], candidates: list[Candidate]) -> list[float]:
    """Per candidate, the share of the focus terms it holds, each weighted by its rarity among the
    candidates (a word in most sentences, "use", says less than "databases")."""
    held = [_stems(c.text) for c in candidates]
    n = max(len(candidates), 1)
    weight = {t: float(np.log(1.0 + n / (1 + sum(t in h for h in held)))) for t in focus}
    total = sum(weight.values())
    if not total:
        return [0.0] * len(candidates)
    return [sum(w for t, w in weight.items() if t in h) / total for h in held]


def _section(chunk: Chunk) -> str:
    section = getattr(chunk, "section", "") or chunk.metadata.get("section")
    return f"{chunk.document_id}#{section}" if section else chunk.document_id


def score(
    question: str,
    chunks: list[Chunk],
    candidates: list[Candidate],
    similarities: list[float] | None,
) -> list[Candidate]:
    """``candidates`` scored (``similarities``: the question's cosine to each; None: words only),
    best first (ties: the better-ranked source, then the earlier sentence)."""
    focus = focus_share(focus_terms(question, chunks), candidates)
    asked = {stem(t) for t in content_terms(question) if t not in FILLER}
    top = _section(chunks[0]) if chunks else ""
    for k, c in enumerate(candidates):
        c.focus = focus[k]
        c.similarity = similarities[k] if similarities is not None else 0.0
        c.score = c.similarity + FOCUS_WEIGHT * c.focus
        if asked:
            c.score += WORDS_WEIGHT * len(asked & _stems(c.text)) / len(asked)
        if _section(chunks[c.source - 1]) == top:
            c.score += SECTION_BONUS
        if c.focus > 0 and answer_type_match(question, c.text):
            c.score += TYPE_BONUS
    return sorted(candidates, key=lambda c: (-c.score, c.source, c.position))


def rule_answers(c: Candidate, embedded: bool) -> bool:
    """Whether a scored candidate answers by the rules (similar enough and holding a focus term)."""
    if embedded:
        return c.score >= MIN_ANSWER_SCORE and c.similarity >= MIN_ANSWER_SIMILARITY
    return c.focus >= MIN_LEXICAL_FOCUS


# How far from the chosen sentence the one holding the asked kind of thing may be: a manual's
# answer often follows the sentence that restates the problem ("By default, Ferrule does not
# cross mount points." then "... use the --cross-mounts=yes option"), or its reference entry's
# head names what the sentence describes ("quor_clone_tree (...)" then "This function will return
# an exact replica ...").
TYPED_REACH = 4


def _typed_neighbour(
    question: str, best: Candidate, chunks: list[Chunk], reach: int = TYPED_REACH
) -> Candidate | None:
    """The sentence of ``best``'s source within ``reach`` of it that holds the kind of thing
    the question asks for (an option, a variable, a function, a file, a number), when it asks for
    one: the one sharing most of the question's words ("-o, --out=FILE output file" for "which
    option sets the output file?"), then the nearest, one after ``best`` before one before it."""
    if not asks_term(question) and not asks_number(question):
        return None
    raws = source_sentences(chunks[best.source - 1])
    terms = set(content_terms(question))
    found: list[tuple[int, int, int, int, str]] = []  # (-shared words, distance, side, place, text)
    for d in range(1, reach + 1):
        for side, k in enumerate((best.position + d, best.position - d)):
            if not 0 <= k < len(raws):
                continue
            text = clean(raws[k])
            if text and not text.endswith("?") and balanced(text) and answer_type_match(question, text):
                found.append((-len(terms & set(content_terms(text))), d, side, k, text))
    if not found:
        return None
    _shared, _d, _side, k, text = min(found)
    return Candidate(best.source, k, text)


def missing_names(question: str, chunks: list[Chunk]) -> list[str]:
    """The names and numbers of ``question`` (capitalised words after the first, words with a
    digit, version numbers such as "5.0" whole), and the words naming what a "which / what ..."
    question asks for, that no source's text or title holds, compared by stem."""
    texts = " ".join(c.text + " " + c.title for c in chunks)
    held = _stems(texts)
    asked: set[str] = set()
    for start, end in sentences(question):  # each sentence's first word is not a name
        asked |= names(question[start:end])
    missing = {n for n in asked if n not in STOPWORDS and stem(n) not in held}
    spelt = {_spelling(w) for w in WORD_RE.findall(texts.lower())}
    missing |= {w for w in asked_kind_words(question) if _spelling(w) not in spelt}
    held_versions = set(_VERSION.findall(texts))
    versions = {v for v in _VERSION.findall(question) if v not in held_versions}
    pieces = {p for v in versions for p in v.split(".")}
    return sorted((missing - pieces) | versions)


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


# British and American spellings of one word ("licence" / "license", "colour" / "color") meet.
_SPELLINGS = (
    (re.compile(r"ence(s?)$"), r"ense\1"),
    (re.compile(r"our(s?)$"), r"or\1"),
    (re.compile(r"is(e|ed|es|ing|ation|ations)$"), r"iz\1"),
)


def _spelling(word: str) -> str:
    for pattern, repl in _SPELLINGS:
        word = pattern.sub(repl, word)
    return stem(word)


def asked_kind_words(question: str) -> set[str]:
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
    return out


# "3.0", "2.10.0": compared whole ("version 3.0" is not in a text that says "2.10.0" and "0").
_VERSION = re.compile(r"(?<![\w.])\d+(?:\.\d+)+(?![\w]|\.\d)")


def verdicts(question: str, candidates: list[Candidate], embedded: bool, missing: bool) -> list[bool]:
    """Whether each candidate, scored by the rules (``score``), answers on its own; none does
    when a name of the question is ``missing`` from every source."""
    answers = [not missing and rule_answers(c, embedded) for c in candidates]
    if asks_number(question):
        # "How many ...", "which year ...": a sentence without a number does not answer, however
        # close it reads.
        answers = [
            a and answer_type_match(question, c.text) for a, c in zip(answers, candidates, strict=True)
        ]
    return answers


class RuleScorer:
    """The rules, with the collection's embedder when ``embed`` is given (else words alone)."""

    name = "rules"

    def __init__(self, embed: Embed | None) -> None:
        self.embed = embed

    async def similarities(self, question: str, candidates: list[Candidate]) -> list[float] | None:
        if self.embed is None or not candidates:
            return None
        texts = [strip_markers(question).strip()] + [c.text for c in candidates]
        vectors = np.asarray(await self.embed(texts), dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != len(texts):
            raise ValueError(f"the embedder returned {vectors.shape[0]} vectors for {len(texts)} texts")
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return [float(s) for s in (vectors[1:] @ vectors[0]).tolist()]

    async def score(self, question: str, chunks: list[Chunk], candidates: list[Candidate]) -> Scored:
        sims = await self.similarities(question, candidates)
        embedded = sims is not None
        score(question, chunks, candidates, sims)
        missing = missing_names(question, chunks)
        answers = verdicts(question, candidates, embedded, bool(missing))
        # words alone tell too little to add a second sentence
        margin = SECOND_MARGIN if embedded else float("-inf")
        return Scored([c.score for c in candidates], answers, self.name, margin, missing)


def with_typed_neighbour(question: str, selection: Selection, chunks: list[Chunk]) -> Selection:
    """``selection`` with the nearby sentence holding the kind of thing asked for (an option, a
    number), when no picked sentence holds one."""
    best = selection.best
    if not selection.found or best is None:
        return selection
    if any(answer_type_match(question, p.text) for p in selection.picked):
        return selection
    kin = _typed_neighbour(question, best, chunks)
    if kin is not None and (kin.source, kin.position) not in places(selection.picked):
        selection.picked = sorted(
            [*selection.picked, kin], key=lambda c: (c.source != best.source, c.source, c.position)
        )
    return selection
