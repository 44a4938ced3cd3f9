"""The source sentences that answer a question, and whether any does.

The chat pipeline's answer step reads the numbered sources the prompt shows the model:

- *candidates* are their sentences that can stand as an answer: never a heading, a question, a
  table's header or rule, or a fragment a chunk boundary cut (``answer_candidates``);
- each is *scored* against the question: the cosine similarity of their embeddings (the
  collection's own embedder), plus the share of the question's *focus terms* it holds (its
  content words that are not in every source: "tandem" in a question over Tandem's docs tells
  no source from another), plus a small bonus for a sentence of the top-ranked section and for
  one holding the kind of thing asked ("how many": a number);
- the question is *answered* when the best candidate is similar enough and holds a focus term;
  otherwise the documents do not say, and the closest sources are listed to see also.

A selected sentence keeps its neighbour when it needs it to make sense: the sentence before
one that opens on "It", "This", "They"..., the one after one that ends on a colon; and when the
question asks for a kind of thing it lacks (an option, a function, a number), the nearby sentence
of its source that holds one. A question asking for a number, a date or a year is answered only
by a sentence holding one.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from services.agent.chunks import Chunk
from services.agent.grounding import (
    FILLER,
    answer_type_match,
    asks_number,
    asks_term,
    names,
    strip_markers,
    unwrap,
)
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
SEE_ALSO = 3

# Sentence openings that lean on the sentence before them.
_ANAPHORA = frozenset(
    [
        "it",
        "its",
        "this",
        "that",
        "these",
        "those",
        "they",
        "them",
        "their",
        "such",
        "so",
        "then",
        "also",
        "however",
        "but",
        "both",
        "each",
        "here",
        "there",
        "otherwise",
        "instead",
        "thus",
        "hence",
        "which",
    ]
)
_BULLET = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")


@dataclass
class Candidate:
    source: int  # 1-based number of its source, as the prompt numbered it
    position: int  # its place among the source's sentences
    text: str  # as shown in an answer (list bullets and table pipes removed)
    similarity: float = 0.0
    focus: float = 0.0
    score: float = 0.0


@dataclass
class Selection:
    """What the sources say to a question: the chosen sentences (with the neighbours they need),
    or nothing (``found`` false) and the sources closest to it."""

    found: bool
    picked: list[Candidate] = field(default_factory=list)
    see_also: list[int] = field(default_factory=list)  # source numbers, closest first
    best: Candidate | None = None
    ranked: list[Candidate] = field(default_factory=list)
    embedded: bool = False  # scored with the embedder (else with words alone)
    # The question's names that no source holds ("Java" in "Which Java SDK ...?"): then the
    # sources cannot answer, however close a sentence reads.
    missing: list[str] = field(default_factory=list)


def _balanced(text: str) -> bool:
    return (
        text.count("(") == text.count(")")
        and text.count("[") == text.count("]")
        and text.count("`") % 2 == 0
        and text.count("**") % 2 == 0
    )


def clean(sentence: str) -> str:
    """A sentence as an answer shows it: no list bullet or bold marks, table cells joined by a dash."""
    text = _BULLET.sub("", sentence.strip())
    if text.startswith("|"):
        cells = [c.strip().replace("\x00", "|") for c in text.replace("\\|", "\x00").strip("|").split("|")]
        text = " — ".join(c for c in cells if c and c != "—")
    return text.replace("**", "").strip()


_FENCE = re.compile(r"^[ \t]*```.*?(?:^[ \t]*```[^\n]*$|\Z)", re.MULTILINE | re.DOTALL)
# Code fenced within a line (a table cell's example, flattened by the HTML parser: "use the
# valgrind-listener program to listen on that port: ``` valgrind-listener 12345 ``` Obviously
# ..."): read as inline code, so the sentence around it can still answer.
_INLINE_FENCE = re.compile(r"```[ \t]*([^`\n]+?)[ \t]*```")


def _sentence_spans(chunk: Chunk) -> tuple[str, list[tuple[int, int]]]:
    """A chunk's text with wrapped lines joined and fenced code left out, and its sentences' spans."""
    text = chunk.text
    if text.count("```") % 2:
        text = text[text.index("```") + 3 :]  # the chunk starts inside a code block
    flat = unwrap(_FENCE.sub("\n", _INLINE_FENCE.sub(r"`\1`", text)))
    return flat, sentences(flat)


def source_sentences(chunk: Chunk) -> list[str]:
    """The sentences of a chunk's text (wrapped lines joined, fenced code left out)."""
    flat, spans = _sentence_spans(chunk)
    return [flat[s:e] for s, e in spans]


def _asking(flat: str, spans: list[tuple[int, int]]) -> set[int]:
    """The places of the sentences that open a question on their line: "I tried X under Valgrind
    but something went wrong. Does Valgrind handle such programs?" (an FAQ's question row) is
    the question, not its answer."""
    return {
        i
        for i in range(len(spans) - 1)
        if flat[spans[i + 1][0] : spans[i + 1][1]].rstrip(" |").endswith("?")
        and "\n" not in flat[spans[i][1] : spans[i + 1][0]]
    }


def answer_candidates(chunks: list[Chunk]) -> list[Candidate]:
    """The sentences of ``chunks`` that can be an answer, in source order."""
    out: list[Candidate] = []
    for n, chunk in enumerate(chunks, start=1):
        flat, spans = _sentence_spans(chunk)
        raws = [flat[s:e] for s, e in spans]
        asking = _asking(flat, spans)
        for i, raw in enumerate(raws):
            text = clean(raw)
            if not text or is_heading(raw) or text.rstrip().endswith("?") or "`" * 3 in raw:
                continue  # a heading, a question, code
            if i in asking:
                continue  # the first half of a question
            if not _balanced(text):
                continue  # a piece of a sentence the chunk boundary or a line break cut
            if i == 0 and text[0].islower() and chunk.start > 0:
                continue  # the chunk boundary cut it: its start is in the previous chunk
            if i == len(raws) - 1 and not re.search(r"[.!:)`\"'|]\s*$", raw.strip()):
                continue  # cut at the chunk's end
            if len(WORD_RE.findall(text)) < 4:
                continue  # "See below." says nothing
            out.append(Candidate(n, i, text))
    return out


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


def _answers(c: Candidate, embedded: bool) -> bool:
    if embedded:
        return c.score >= MIN_ANSWER_SCORE and c.similarity >= MIN_ANSWER_SIMILARITY
    return c.focus >= MIN_LEXICAL_FOCUS


def _with_neighbours(best: Candidate, chunks: list[Chunk]) -> list[Candidate]:
    """``best`` and the sentences of its source it leans on: the one before when it opens on a
    word pointing back, the one after when it ends on a colon (a list follows)."""
    raws = source_sentences(chunks[best.source - 1])
    out = [best]
    if _BULLET.match(raws[best.position]) and best.text[:1].islower():
        # A list item that continues its lead-in ("`tandem up` (what `make up` runs):" then
        # "3. on first start creates an API key ..."): the item alone has no subject.
        lead = _lead_in(raws, best.position)
        if lead is not None:
            out.insert(0, Candidate(best.source, lead, clean(raws[lead])))
    first = WORD_RE.findall(best.text)[:1]
    if len(out) == 1 and first and first[0].lower() in _ANAPHORA and best.position > 0:
        raw = raws[best.position - 1]
        prev = clean(raw)
        if prev and not is_heading(raw) and not prev.endswith("?") and _balanced(prev):
            out.insert(0, Candidate(best.source, best.position - 1, prev))
    if best.text.rstrip().endswith(":") and best.position + 1 < len(raws):
        raw = raws[best.position + 1]
        nxt = clean(raw)
        if nxt and not is_heading(raw) and _balanced(nxt):
            out.append(Candidate(best.source, best.position + 1, nxt))
    return out


# How far from the chosen sentence the one holding the asked kind of thing may be: a manual's
# answer often follows the sentence that restates the problem ("By default, statically linked
# malloc functions are not replaced." then "... use --soname-synonyms=somalloc=NONE"), or its
# reference entry's head names what the sentence describes ("asn1_dup_node (...)" then "This
# function will return an exact copy ...").
TYPED_REACH = 4


def _typed_neighbour(
    question: str, best: Candidate, chunks: list[Chunk], reach: int = TYPED_REACH
) -> Candidate | None:
    """The sentence of ``best``'s source within ``reach`` of it that holds the kind of thing
    the question asks for (an option, a variable, a function, a file, a number), when it asks for
    one: the one sharing most of the question's words ("-n, --name=NAME array name" for "which
    option sets the array name?"), then the nearest, one after ``best`` before one before it."""
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
            if text and not text.endswith("?") and _balanced(text) and answer_type_match(question, text):
                found.append((-len(terms & set(content_terms(text))), d, side, k, text))
    if not found:
        return None
    _shared, _d, _side, k, text = min(found)
    return Candidate(best.source, k, text)


def _lead_in(raws: list[str], position: int) -> int | None:
    """The sentence that introduces the list holding ``raws[position]``: the nearest one before
    it that is not a list item, when it ends on a colon (a short lead-in looks like a heading to
    ``is_heading``; a Markdown heading is never one)."""
    for k in range(position - 1, -1, -1):
        raw = raws[k]
        if _BULLET.match(raw):
            continue
        text = clean(raw)
        if text.endswith(":") and not raw.lstrip().startswith("#") and _balanced(text):
            return k
        return None
    return None


def select(
    question: str, chunks: list[Chunk], similarities: list[float] | None, candidates: list[Candidate]
) -> Selection:
    """The answer ``chunks`` give to ``question`` (``similarities``: one per candidate, or None)."""
    embedded = similarities is not None
    ranked = score(question, chunks, candidates, similarities)
    closest: list[int] = []
    for c in ranked:
        if c.source not in closest:
            closest.append(c.source)
    closest += [n for n in range(1, len(chunks) + 1) if n not in closest]
    missing = missing_names(question, chunks)
    answering = [] if missing else [c for c in ranked if _answers(c, embedded)]
    if asks_number(question):
        # "How many ...", "when ...": a sentence without a number does not answer, however
        # close it reads.
        answering = [c for c in answering if answer_type_match(question, c.text)]
    if not answering:
        return Selection(
            False,
            see_also=closest[:SEE_ALSO],
            best=ranked[0] if ranked else None,
            ranked=ranked,
            embedded=embedded,
            missing=missing,
        )
    best = answering[0]
    picked = _with_neighbours(best, chunks)
    if not any(answer_type_match(question, p.text) for p in picked):
        kin = _typed_neighbour(question, best, chunks)
        if kin is not None and (kin.source, kin.position) not in _places(picked):
            picked = sorted([*picked, kin], key=lambda c: c.position)
    for c in answering[1:2] if embedded else []:
        # nearly as close, and holding at least as much of what the question asks for
        close = c.score >= best.score - SECOND_MARGIN and c.focus >= best.focus
        close = close and _section(chunks[c.source - 1]) == _section(chunks[best.source - 1])
        if close and _key(c.text) not in {_key(p.text) for p in picked}:
            picked += [
                n for n in _with_neighbours(c, chunks) if (n.source, n.position) not in _places(picked)
            ]
    return Selection(True, picked=picked, best=best, ranked=ranked, embedded=embedded)


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


# "Which blockchain stores ...", "What is the phone number of ...", "What file format does ...": the
# words after "which" / "what (is the)" name the kind of thing asked for. Sources that never name
# that kind cannot say which one it is.
_ASKED_KIND = re.compile(
    r"\b(?:which|what)\s+(?:(?:is|are|was|were)\s+(?:the|a|an)\s+)?((?:[\w.'-]+\s+){1,4})",
    re.IGNORECASE,
)
# words that name no kind of their own ("what kind of", "which one"); kinds a source states by an
# instance, not by name ("18 August 2022" answers "which date", "$5" "what price"); and the kinds
# a manual writes as terms (`--smc-check=all` answers "which option", `celery -A ... worker`
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
    "phone" of "What is the phone number of ...", "file" and "format" of "What file format does
    ...". The phrase is the words before the first stopword, at most three, less a last word an
    article follows ("Which index holds the ...": a verb); where no stopword ends it that soon
    ("Which blockchain stores Tandem's ..."), its first word alone ("blockchain"): without a
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


# "5.0", "3.19.0": compared whole ("version 5.0" is not in a text that says "4.19.0" and "0").
_VERSION = re.compile(r"(?<![\w.])\d+(?:\.\d+)+(?![\w]|\.\d)")


def _places(picked: list[Candidate]) -> set[tuple[int, int]]:
    return {(p.source, p.position) for p in picked}


def _key(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


async def select_answer(question: str, chunks: list[Chunk], embed: Embed | None) -> Selection:
    """``select`` with the similarities from ``embed`` (one call: the question and every candidate);
    ``embed`` None: words alone. Its errors propagate (the caller falls back to words)."""
    candidates = answer_candidates(chunks)
    if embed is None or not candidates:
        return select(question, chunks, None, candidates)
    texts = [strip_markers(question).strip()] + [c.text for c in candidates]
    vectors = np.asarray(await embed(texts), dtype=np.float32)
    if vectors.ndim != 2 or vectors.shape[0] != len(texts):
        raise ValueError(f"the embedder returned {vectors.shape[0]} vectors for {len(texts)} texts")
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    sims = (vectors[1:] @ vectors[0]).tolist()
    return select(question, chunks, [float(s) for s in sims], candidates)


def _cited(text: str, n: int) -> str:
    body = text.rstrip()
    end = body[-1] if body and body[-1] in ".!:" else "."
    # a list item's ";" or "," ends the answer: "... the next `tandem up` [1]."
    return f"{body.rstrip('.!:;,').rstrip()} [{n}]{end}"


def extractive_text(selection: Selection) -> tuple[str, list[int]]:
    """The picked sentences, the last of each source followed by its ``[n]``; the numbers used."""
    parts: list[str] = []
    for k, c in enumerate(selection.picked):
        last = k + 1 == len(selection.picked) or selection.picked[k + 1].source != c.source
        parts.append(_cited(c.text, c.source) if last else c.text)
    return " ".join(parts), sorted({c.source for c in selection.picked})


def _asked(question: str) -> str:
    """The question as what the documents do not say: "how many cores the setup needs" reads
    well enough as "how many cores does the setup need"."""
    text = strip_markers(question).strip().rstrip("?.! ").strip()
    if text[:1].isupper() and not text[1:2].isupper():
        text = text[0].lower() + text[1:]
    return text


def not_found_text(
    question: str, chunks: list[Chunk], see_also: list[int], missing: list[str] | None = None
) -> str:
    """ "Your documents do not say ...", what of the question they never mention, then the
    closest sources by title and number."""
    text = f"Your documents do not say {_asked(question)}."
    if missing:
        spelt = {w.lower(): w for w in WORD_RE.findall(question)}
        text += f" They do not mention {', '.join(spelt.get(n, n) for n in missing)}."
    if see_also:
        named = [f"{chunks[n - 1].title or chunks[n - 1].document_id} [{n}]" for n in see_also]
        text += " See also: " + "; ".join(named) + "."
    return text
