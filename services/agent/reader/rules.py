"""The fallback scorer: the collection's embedder and hand-written English rules.

Used when no reader model is served (``services/agent/reader/scorer.py``), and the baseline the
reader is measured against (benchmarks/answers/reader_eval.py). Each candidate is scored by the
cosine similarity of its embedding to the question's, plus the share of the question's *focus
terms* it holds (its content words that are not in every source), plus small bonuses for a
sentence of the top-ranked section and for one holding the kind of thing asked ("how many": a
number). It answers when similar enough and holding a focus term; a question naming something
no source holds ("Which Kotlin client ...") is answered by none, and one asking for a number only by a
sentence holding one.

The question comes parsed (``question.Asked``): the rules read its fields for every candidate,
and the patterns here read sentences only.

These are rules for English text: the reader replaces them wherever it is served.
"""

from __future__ import annotations

import re

import numpy as np

from services.agent.chunks import Chunk
from services.agent.reader.question import CONSTANT, TOKEN, VERSION, WRITTEN, Asked, parsed
from services.agent.reader.scorer import Scored
from services.agent.reader.select import Selection, places
from services.agent.reader.similarity import Similarity
from services.common.candidates import Candidate, balanced, clean, source_sentences
from services.common.text import STOPWORDS, WORD_RE, content_terms, is_heading, stem

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
# A number standing alone: "15 s", "3 to 5 times", "2.10.0", not the digit of "X.25" or "md5".
_NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,:]\d+)*(?!\w)")
# how far before (a subject: "Ledger is the only mode") and after ("variable QUOR_TRACE")
# the kind's word an instance may stand
_INSTANCE_BEFORE = 4
_INSTANCE_AFTER = 2


def _name_like(token: str, first: bool) -> bool:
    if token.startswith("`"):
        return True
    body = token if not first else token[1:]
    return any(ch.isupper() or ch.isdigit() or ch in "-_./" for ch in body)


def names_instance(asked: Asked, sentence: str) -> bool:
    """Whether ``sentence`` names a thing of the kind a "which ..." question asks for: a name the
    question lacks within a few words of the kind's word."""
    kinds = asked.kind_nouns
    if not kinds:
        return False
    known = asked.tokens
    tokens = TOKEN.findall(sentence)
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


def asked_terms(asked: Asked, sentence: str) -> list[str] | None:
    """The terms of the kind the question asks for ("which option": ``--deep-scan``; "which
    variable": ``QUOR_TRACE``; "which function": ``quor_clone_tree``; "which file": ``libquor.h``)
    that ``sentence`` holds and the question does not; None when it asks for no such kind."""
    if not asked.term_kinds:
        return None
    known = asked.known_terms
    return [t for kind in asked.term_kinds for t in WRITTEN[kind].findall(sentence) if t.lower() not in known]


def _names_month(sentence: str) -> bool:
    """A month's name, capitalised as a date writes it ("May 2024", not "you may")."""
    return any(w.lower() in _MONTHS for w in re.findall(r"\b[A-Z][a-z]+\b", sentence))


def answer_type_match(asked: Asked, sentence: str) -> bool:
    """Whether ``sentence`` holds the kind of thing the question asks for: a number for "how deep",
    a month for "which month", a name (a capitalised word the question lacks) for "who", a term
    written as a manual writes one for "which option / variable / function / file"."""
    if asked.month and _names_month(sentence):
        return True
    if asked.year:
        return bool(re.search(r"\b(1[5-9]|20)\d\d\b", sentence)) or _names_month(sentence)
    if asked.number:
        return bool(_NUMBER.search(sentence) or (asked.size and CONSTANT.search(sentence)))
    if asked.person:
        words = re.findall(r"[A-Za-z]+", sentence)[1:]  # the first word is capitalised anyway
        return any(w[0].isupper() and w.lower() not in asked.letters for w in words)
    terms = asked_terms(asked, sentence)
    if terms is not None:
        return bool(terms)  # a kind with a written form ("--check" for "which option")
    if names_instance(asked, sentence):
        return True
    if asked.verb is None:
        return False
    return asked.verb in {stem(w) for w in re.findall(r"[a-z]+", sentence.lower())}


def focus_terms(asked: Asked, chunks: list[Chunk]) -> list[str]:
    """The question's content words (filler aside) that are not in every source's body (its
    headings aside: a heading that repeats the question says nothing about where the answer is)."""
    terms = list(asked.focus)
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
    asked: Asked,
    chunks: list[Chunk],
    candidates: list[Candidate],
    similarities: list[float] | None,
) -> list[Candidate]:
    """``candidates`` scored (``similarities``: the question's cosine to each; None: words only),
    best first (ties: the better-ranked source, then the earlier sentence)."""
    focus = focus_share(focus_terms(asked, chunks), candidates)
    stems = asked.focus_stems
    top = _section(chunks[0]) if chunks else ""
    for k, c in enumerate(candidates):
        c.focus = focus[k]
        c.similarity = similarities[k] if similarities is not None else 0.0
        c.score = c.similarity + FOCUS_WEIGHT * c.focus
        if stems:
            c.score += WORDS_WEIGHT * len(stems & _stems(c.text)) / len(stems)
        if _section(chunks[c.source - 1]) == top:
            c.score += SECTION_BONUS
        if c.focus > 0 and answer_type_match(asked, c.text):
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
    asked: Asked, best: Candidate, chunks: list[Chunk], reach: int = TYPED_REACH
) -> Candidate | None:
    """The sentence of ``best``'s source within ``reach`` of it that holds the kind of thing
    the question asks for (an option, a variable, a function, a file, a number), when it asks for
    one: the one sharing most of the question's words ("-o, --out=FILE output file" for "which
    option sets the output file?"), then the nearest, one after ``best`` before one before it."""
    if not asked.asks_term and not asked.asks_number:
        return None
    raws = source_sentences(chunks[best.source - 1])
    terms = set(asked.terms)
    found: list[tuple[int, int, int, int, str]] = []  # (-shared words, distance, side, place, text)
    for d in range(1, reach + 1):
        for side, k in enumerate((best.position + d, best.position - d)):
            if not 0 <= k < len(raws):
                continue
            text = clean(raws[k])
            if text and not text.endswith("?") and balanced(text) and answer_type_match(asked, text):
                found.append((-len(terms & set(content_terms(text))), d, side, k, text))
    if not found:
        return None
    _shared, _d, _side, k, text = min(found)
    return Candidate(best.source, k, text)


def missing_names(asked: Asked, chunks: list[Chunk]) -> list[str]:
    """The names and numbers of the question (capitalised words after the first, words with a
    digit, version numbers such as "5.0" whole), and the words naming what a "which / what ..."
    question asks for, that no source's text or title holds, compared by stem."""
    texts = " ".join(c.text + " " + c.title for c in chunks)
    held = _stems(texts)
    missing = {n for n in asked.names if n not in STOPWORDS and stem(n) not in held}
    spelt = {_spelling(w) for w in WORD_RE.findall(texts.lower())}
    missing |= {w for w in asked.kind_words if _spelling(w) not in spelt}
    held_versions = set(VERSION.findall(texts))
    versions = {v for v in asked.versions if v not in held_versions}
    pieces = {p for v in versions for p in v.split(".")}
    return sorted((missing - pieces) | versions)


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


def verdicts(asked: Asked, candidates: list[Candidate], embedded: bool, missing: bool) -> list[bool]:
    """Whether each candidate, scored by the rules (``score``), answers on its own; none does
    when a name of the question is ``missing`` from every source."""
    answers = [not missing and rule_answers(c, embedded) for c in candidates]
    if asked.asks_number:
        # "How many ...", "which year ...": a sentence without a number does not answer, however
        # close it reads.
        answers = [a and answer_type_match(asked, c.text) for a, c in zip(answers, candidates, strict=True)]
    return answers


class RuleScorer:
    """The rules, with the collection's embedder's similarities when ``similarity`` is given (else
    words alone)."""

    name = "rules"

    def __init__(self, similarity: Similarity | None) -> None:
        self.similarity = similarity

    async def similarities(self, asked: Asked, candidates: list[Candidate]) -> list[float] | None:
        if self.similarity is None or not candidates:
            return None
        sims = await self.similarity(asked.embedded, [c.text for c in candidates])
        if len(sims) != len(candidates):
            raise ValueError(f"{len(sims)} similarities for {len(candidates)} sentences")
        return sims

    async def score(self, question: str | Asked, chunks: list[Chunk], candidates: list[Candidate]) -> Scored:
        asked = parsed(question)
        sims = await self.similarities(asked, candidates)
        embedded = sims is not None
        score(asked, chunks, candidates, sims)
        missing = missing_names(asked, chunks)
        answers = verdicts(asked, candidates, embedded, bool(missing))
        # words alone tell too little to add a second sentence
        margin = SECOND_MARGIN if embedded else float("-inf")
        return Scored([c.score for c in candidates], answers, self.name, margin, missing)


def with_typed_neighbour(asked: Asked, selection: Selection, chunks: list[Chunk]) -> Selection:
    """``selection`` with the nearby sentence holding the kind of thing asked for (an option, a
    number), when no picked sentence holds one."""
    best = selection.best
    if not selection.found or best is None:
        return selection
    if any(answer_type_match(asked, p.text) for p in selection.picked):
        return selection
    kin = _typed_neighbour(asked, best, chunks)
    if kin is not None and (kin.source, kin.position) not in places(selection.picked):
        selection.picked = sorted(
            [*selection.picked, kin], key=lambda c: (c.source != best.source, c.source, c.position)
        )
    return selection
