"""The groundedness guard: is each answer sentence supported by a source, and is the answer usable?

A small model (SmolLM2-135M) often writes an answer that says nothing ("The answer is:"),
loops on one sentence, or drifts away from its sources. The guard judges the answer
sentence by sentence against the sources the prompt numbered, with lexical overlap and, for
the sentences that overlap misses, the collection's own embedder (no extra model):

- a sentence is *supported* when most of its fact words (its content words, citation markers,
  filler such as "answer" and the question's own words aside) appear in one source sentence,
  or (``with_embeddings``) when its embedding is close enough to one source sentence's; either
  way only a source holding all of the sentence's names and numbers can support it;
- an answer is *degenerate* when it is empty, repeats a sentence, is a bare preamble
  (nothing beyond filler and the question's words), or has no supported sentence.

A degenerate answer is replaced by an *extractive* one: the source sentences that best
answer the question, each followed by its ``[n]``. A partly supported answer is kept, and
its unsupported sentences are reported so a client can show them dimmed.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from services.agent.chunks import Chunk
from services.agent.citations import MARKER_RE, TITLE_MARKER_RE
from services.agent.text import STOPWORDS, content_terms, is_heading, overlap, sentences, stem

# Words that carry no fact of their own in an answer ("Based on the sources, the answer is ...").
FILLER = frozenset(
    content_terms(
        "answer answers question questions source sources based according provided following given "
        "information context document documents text mention mentioned state stated say says "
        "know sure sorry unfortunately here help"
    )
)

Verdict = Literal["ok", "partial", "empty", "repeated", "preamble", "unsupported"]


@dataclass
class SentenceCheck:
    text: str
    start: int
    end: int
    support: float  # share of the sentence's fact words (beyond the question's) in its best source sentence
    source: int | None  # 1-based number of that source
    substantive: bool  # says something beyond filler and the question's own words
    # Cosine similarity to the closest source sentence holding its names and numbers: only
    # computed (``with_embeddings``) for a substantive sentence the overlap does not support.
    similarity: float | None = None

    @property
    def supported(self) -> bool:
        return self.source is not None


@dataclass
class GroundingReport:
    verdict: Verdict
    sentences: list[SentenceCheck] = field(default_factory=list)

    @property
    def degenerate(self) -> bool:
        return self.verdict not in ("ok", "partial")

    @property
    def unsupported(self) -> list[SentenceCheck]:
        return [s for s in self.sentences if s.substantive and not s.supported]

    @property
    def share(self) -> float | None:
        """Supported share of the substantive sentences (None when there are none)."""
        judged = [s for s in self.sentences if s.substantive]
        return sum(s.supported for s in judged) / len(judged) if judged else None


def strip_markers(text: str) -> str:
    return TITLE_MARKER_RE.sub(" ", MARKER_RE.sub(" ", text))


def _key(sentence: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", strip_markers(sentence).lower()))


def repeats_sentence(answer: str, min_chars: int = 8) -> bool:
    """True when one sentence of ``answer`` (markers ignored) occurs twice."""
    seen: set[str] = set()
    for s, e in sentences(answer):
        key = _key(answer[s:e])
        if len(key) < min_chars:
            continue
        if key in seen:
            return True
        seen.add(key)
    return False


# A line break inside a paragraph (wrapped Markdown or plain text) does not end a sentence; one
# before a heading, list item, table row, quote, code fence or a line of an option table
# ("-c, --check checks the syntax only") does. A wrapped line may start with an option itself
# ("... invoked with the\n--tool option."): that one goes on. A heading's own line ends it ("## 1
# Introduction" then "This document describes ...": two lines, not one sentence that reads as
# a heading).
_WRAP = re.compile(
    r"(^[ \t]*#[^\n]*\n)|[ \t]*\n(?![ \t]*(?:\n|[#>|]|[*+-][ \t]|-\w, |\d+[.)]|```))[ \t]*", re.MULTILINE
)


def unwrap(text: str) -> str:
    return _WRAP.sub(lambda m: m.group(1) or " ", text)


def _source_sentences(texts: list[str]) -> list[tuple[int, str]]:
    out = []
    for n, text in enumerate(texts, start=1):
        flat = unwrap(text)
        out += [(n, flat[s:e]) for s, e in sentences(flat)]
    return out


def names(sentence: str) -> set[str]:
    """The sentence's names and numbers (lower-cased): capitalised words after the first, and
    numbers ("source 2" aside). A supported sentence must not bring one its source lacks."""
    text = re.sub(r"\bsources?\s*\d+", " ", strip_markers(sentence), flags=re.IGNORECASE)
    words = re.findall(r"[A-Za-z0-9]+", text)
    out = {w.lower() for w in words if any(ch.isdigit() for ch in w)}
    out |= {w.lower() for w in words[1:] if w[0].isupper() and len(w) > 1 and stem(w) not in FILLER}
    return out


def _vocab(sources: list[str]) -> list[set[str]]:
    return [{w.lower() for w in re.findall(r"[A-Za-z0-9]+", src)} for src in sources]


def check(
    answer: str, question: str, sources: list[str], min_support: float = 0.5, repeated: bool = False
) -> GroundingReport:
    """Judges ``answer`` against ``sources`` (texts, numbered from 1 as the prompt numbered them)."""
    asked = set(content_terms(question))
    pool = _source_sentences(sources)
    vocab = _vocab(sources)
    checks: list[SentenceCheck] = []
    for s, e in sentences(answer):
        text = answer[s:e]
        terms = [t for t in content_terms(strip_markers(text)) if t not in FILLER]
        facts = [t for t in terms if t not in asked]
        best, where = 0.0, None
        named = names(text)
        if facts:
            # Judged on what the sentence adds to the question: a misspelt name is not supported
            # just because the sentence repeats the question's words around it; and a source
            # supports it only if it holds all its names and numbers (not another town's mayor,
            # not a depth the model made up).
            for n, src in pool:
                if not named <= vocab[n - 1]:
                    continue
                score = overlap(facts, src)
                if score > best:
                    best, where = score, n
        checks.append(
            SentenceCheck(
                text=text,
                start=s,
                end=e,
                support=best,
                source=where if best >= min_support and facts else None,
                substantive=bool(facts),
            )
        )
    return _verdict(answer, checks, repeated)


def _verdict(answer: str, checks: list[SentenceCheck], repeated: bool) -> GroundingReport:
    if not strip_markers(answer).strip():
        return GroundingReport("empty", checks)
    if repeated or repeats_sentence(answer):
        return GroundingReport("repeated", checks)
    if not any(c.substantive for c in checks):
        return GroundingReport("preamble", checks)
    if not any(c.supported for c in checks):
        return GroundingReport("unsupported", checks)
    return GroundingReport(
        "partial" if any(not c.supported for c in checks if c.substantive) else "ok", checks
    )


# Texts in, one L2-normalised vector per text out (the agent calls inference's /v1/embeddings
# with the collection's embedding model).
Embed = Callable[[list[str]], Awaitable[list[list[float]]]]

# Measured with all-MiniLM-L6-v2 (the default embedder) on the invented facts (benchmarks/RESULTS.md,
# "answers"): of the paraphrases of a fact that the overlap misses, 0.85 keeps 22/27 (seed 1) and
# 23/27 (seed 2) and no unsupported claim about the same entity (0/39 on each); 0.8 keeps one or two
# more paraphrases but also "Mount X is the highest mountain in the region" (0.81). The model's own
# unsupported sentences score at most 0.65.
MIN_SIMILARITY = 0.85


async def with_embeddings(
    report: GroundingReport,
    answer: str,
    sources: list[str],
    embed: Embed,
    min_similarity: float = MIN_SIMILARITY,
) -> GroundingReport:
    """``report`` (from ``check``) with the sentences the overlap missed judged again by embedding:
    one is supported when its cosine similarity to a source sentence (of a source holding all its
    names and numbers) reaches ``min_similarity``. Calls ``embed`` once, and only when some
    substantive sentence is unsupported and could still be; its errors propagate."""
    if report.verdict in ("empty", "repeated", "preamble", "ok"):
        return report  # nothing that a similarity could change
    pool = _source_sentences(sources)
    vocab = _vocab(sources)
    todo: list[tuple[SentenceCheck, list[int]]] = []
    for c in report.sentences:
        if c.substantive and not c.supported:
            named = names(c.text)
            candidates = [i for i, (n, _) in enumerate(pool) if named <= vocab[n - 1]]
            if candidates:
                todo.append((c, candidates))
    if not todo:
        return report
    wanted = sorted({i for _, cands in todo for i in cands})
    texts = [strip_markers(c.text).strip() for c, _ in todo] + [pool[i][1].strip() for i in wanted]
    vectors = np.asarray(await embed(texts), dtype=np.float32)
    if vectors.shape[0] != len(texts):
        raise ValueError(f"the embedder returned {vectors.shape[0]} vectors for {len(texts)} texts")
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    row = {i: len(todo) + k for k, i in enumerate(wanted)}
    for k, (c, cands) in enumerate(todo):
        sims = [(float(vectors[k] @ vectors[row[i]]), -i) for i in cands]
        best, neg_i = max(sims)
        c.similarity = best
        if best >= min_similarity:
            c.source = pool[-neg_i][0]
    return _verdict(answer, report.sentences, repeated=False)


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
# A named constant as a manual writes one: "GLIBCXX_FORCE_NEW", "ASN1_MEM_ERROR" (not "-D__X").
_CONSTANT = re.compile(r"(?<![\w-])[A-Z][A-Z0-9]*_[A-Z0-9_]+\b")
# "When ...?" asks for a time; "When building fails with X, which package ...?" is a condition.
_WHEN_Q = r"^\s*when\b(?![^?]*,\s*(?:which|what|how|who|whom|where|why|is|are|does|do|can|should)\b)"
_NUMBER_Q = re.compile(
    rf"\bhow (many|much|deep|high|tall|long|old|far|big|large|wide|heavy)\b|{_WHEN_Q}"
    r"|\b(what|which)( \w+){0,3} (year|date|number|version)\b|\bnumeric\b"
)
# A number standing alone: "15 s", "20 to 30 times", "4.19.0", not the digit of "ASN.1" or "asn1".
_NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,:]\d+)*(?!\w)")
# "How large must the buffer be?": a manual may answer with a named constant
# ("at least ASN1_MAX_ERROR_DESCRIPTION_SIZE").
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
        # "What does asn1_read_value return when ...?": a constant, a number, NULL
        re.compile(r"\bwhat\b.*\breturns?\b|\bwhat\b.*\bset to\b"),
        re.compile(rf"{_CONSTANT.pattern}|(?<![\w.-])-1\b|\bNULL\b|\b(?:true|false)\b"),
    ),
]


def asks_term(question: str) -> bool:
    """Whether ``question`` asks for an option, a variable, a function, a file or a return value,
    or names the kind of thing it asks for ("which program ...", "which tool ...")."""
    q = question.lower()
    return any(asked.search(q) for asked, _term in _TERM_KINDS) or bool(_kind_nouns(question))


# "Which program listens ...", "Which Valgrind tool is the default tool?", "which package do you
# need": the words after "which" (up to a stopword, at most three) name the kind of thing asked
# for; a manual names one beside the kind's own word ("the valgrind-listener program", "run the
# Memcheck tool", "install the glibc-static-devel package", "Callgrind is the only tool").
_WHICH = re.compile(r"\bwhich\s+((?:[\w.'-]+\s+){1,3})", re.IGNORECASE)
# A token as a manual writes a name: inline code, or a word with a capital after its first letter
# place, a digit, "-", "_", "." or "/" inside it.
_TOKEN = re.compile(r"`[^`]+`|[A-Za-z0-9][\w.+/-]*[\w+]|[A-Za-z]")
# how far before (a subject: "Callgrind is the only tool") and after ("variable GLIBCXX_FORCE_NEW")
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
                continue  # "--tool" is the kind's own word, not a tool
            if _name_like(other, first=k == 0):
                return True
    return False


def asked_terms(question: str, sentence: str) -> list[str] | None:
    """The terms of the kind ``question`` asks for ("which option": ``--leak-check``; "which
    variable": ``GLIBCXX_FORCE_NEW``; "which function": ``asn1_dup_node``; "which file": ``libtasn1.h``)
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
    """Whether ``question`` asks for a number, a date or a year ("how many", "when", "which
    version"): an answer without one does not answer it."""
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


def is_fragment(sentence: str) -> bool:
    """Cut by a chunk boundary: starts in lower case, or ends without punctuation."""
    text = sentence.strip().lstrip("-*+#> ").strip()
    if not text:
        return True
    return text[0].islower() or text[-1] not in ".!?:)`\"'"


def extractive_answer(question: str, chunks: list[Chunk], max_sentences: int = 2) -> tuple[str, list[int]]:
    """The source sentences that best answer ``question``, each with its ``[n]``; and the numbers used
    (by words alone: the pipeline's answer step, services/agent/pipelines/selection.py, ranks them
    with the collection's embedder when it can). Headings and questions are never chosen.

    Sentences are ranked by the share of the question's content words they hold (plus a bonus
    when they hold the kind of thing asked for: a number, a month, a name; ties: the
    better-ranked source first). A second sentence is added only when it scores nearly as well,
    so the answer stays short.
    """
    terms = content_terms(question)
    scored: list[tuple[float, int, int, str]] = []
    for n, text in _source_sentences([c.text for c in chunks]):
        if is_heading(text) or text.rstrip().endswith("?"):
            continue  # a heading or a question is never an answer
        score = overlap(terms, text + " " + chunks[n - 1].title) if terms else 0.0
        # Ties between sentences of one source (the title counts for each): the one that names
        # more of the question itself wins.
        score += 0.3 * overlap(terms, text) if terms else 0.0
        if score > 0 and answer_type_match(question, text):
            score += 0.25  # tells the asked sentence from others about the same entity
        if is_fragment(text):
            score *= 0.7  # a chunk boundary cut it: a whole sentence reads better, if one is as good
        scored.append((score, -n, -len(scored), text.strip()))
    if not scored:
        return "", []
    scored.sort(reverse=True)
    best = scored[0][0]
    picked: list[tuple[int, str]] = []
    for score, neg_n, _, text in scored:
        if len(picked) >= max_sentences or (picked and score < max(0.5, 0.95 * best)):
            break
        if any(_key(text) == _key(t) for _, t in picked):
            continue
        picked.append((-neg_n, text))
    parts = []
    for n, text in picked:
        body = text.rstrip()
        end = body[-1] if body and body[-1] in ".!?" else "."
        body = body.rstrip(".!?")
        parts.append(f"{body} [{n}]{end}")
    return " ".join(parts), sorted({n for n, _ in picked})
