"""Small text helpers shared by relevance, highlighting, rewriting and attribution."""

from __future__ import annotations

import functools
import re
import threading

import Stemmer

_STEMMERS = threading.local()  # a PyStemmer stemmer is not thread-safe: one per thread
# Letters of any script make words ("Größe", "déjà", "naïve"), with an apostrophe's ending kept.
WORD_RE = re.compile(r"[^\W_]+(?:['’][^\W_]+)?")
# A sentence ends at . ! or ? followed by a space, a line break or the end: not inside "96.875",
# ".tandem/api-key" or "e.g.x".
# A numbered list item's marker ("3. ") opens its sentence instead of being one, and "ie.",
# "e.g.", "cf." and "vs." followed by a space go on with it.
_ABBREVIATION = r"(?i:(?:(?<=\bie)|(?<=\beg)|(?<=\bi\.e)|(?<=\be\.g)|(?<=\bcf)|(?<=\bvs))\.[ \t]+)"
SENTENCE_RE = re.compile(
    rf"(?:^[ \t]*\d{{1,3}}[.)][ \t]+)?(?:{_ABBREVIATION}|[^.!?\n]|[.!?]+(?=[^\s.!?]))+(?:[.!?]+|\n|$)",
    re.MULTILINE,
)
_TABLE_RULE = re.compile(r"^\|?[\s:|-]+\|?$")

STOPWORDS = frozenset(
    [
        "a",
        "about",
        "above",
        "after",
        "again",
        "against",
        "all",
        "am",
        "an",
        "and",
        "any",
        "are",
        "as",
        "at",
        "be",
        "because",
        "been",
        "before",
        "being",
        "below",
        "between",
        "both",
        "but",
        "by",
        "can",
        "could",
        "did",
        "do",
        "does",
        "doing",
        "down",
        "during",
        "each",
        "few",
        "for",
        "from",
        "further",
        "had",
        "has",
        "have",
        "having",
        "he",
        "her",
        "here",
        "hers",
        "herself",
        "him",
        "himself",
        "his",
        "how",
        "i",
        "if",
        "in",
        "into",
        "is",
        "it",
        "its",
        "itself",
        "just",
        "me",
        "more",
        "most",
        "my",
        "myself",
        "no",
        "nor",
        "not",
        "now",
        "of",
        "off",
        "on",
        "once",
        "only",
        "or",
        "other",
        "our",
        "ours",
        "ourselves",
        "out",
        "over",
        "own",
        "same",
        "she",
        "should",
        "so",
        "some",
        "such",
        "than",
        "that",
        "the",
        "their",
        "theirs",
        "them",
        "themselves",
        "then",
        "there",
        "these",
        "they",
        "this",
        "those",
        "through",
        "to",
        "too",
        "under",
        "until",
        "up",
        "very",
        "was",
        "we",
        "were",
        "what",
        "when",
        "where",
        "which",
        "while",
        "who",
        "whom",
        "why",
        "will",
        "with",
        "would",
        "you",
        "your",
        "yours",
        "yourself",
        "yourselves",
        "tell",
        "please",
        "explain",
        "describe",
        "give",
        "show",
        "know",
        "say",
        "said",
        "also",
        "does",
        "did",
        "much",
        "many",
        "it's",
        "what's",
        "who's",
    ]
)


@functools.lru_cache(maxsize=65536)
def stem(word: str) -> str:
    """The word's Snowball (English) stem, lower-cased: 'databases'/'database', 'uses'/'using',
    'queries'/'query' meet (PyStemmer, the stemmer retrieval's BM25 uses)."""
    stemmer = getattr(_STEMMERS, "english", None)
    if stemmer is None:
        stemmer = _STEMMERS.english = Stemmer.Stemmer("english")
    return str(stemmer.stemWord(word.lower().replace("’", "'").removesuffix("'s")))


def content_terms(text: str, stemmed: bool = True) -> list[str]:
    """Lower-cased (and stemmed) words of ``text`` without stopwords, in order, de-duplicated."""
    seen: dict[str, None] = {}
    for match in WORD_RE.finditer(text):
        word = match.group(0).lower()
        if word in STOPWORDS or len(word) < 2:
            continue
        seen.setdefault(stem(word) if stemmed else word, None)
    return list(seen)


def term_spans(text: str, terms: set[str]) -> list[tuple[int, int]]:
    """Character spans of the words of ``text`` whose stem is in ``terms``."""
    return [(m.start(), m.end()) for m in WORD_RE.finditer(text) if stem(m.group(0)) in terms]


def overlap(query_terms: list[str], text: str) -> float:
    """Share of ``query_terms`` present in ``text`` (0 when the query has none)."""
    if not query_terms:
        return 0.0
    present = {stem(m.group(0)) for m in WORD_RE.finditer(text)}
    return sum(1 for t in query_terms if t in present) / len(query_terms)


def sentences(text: str) -> list[tuple[int, int]]:
    """Spans of the sentences of ``text`` (trimmed of surrounding whitespace)."""
    spans = []
    for m in SENTENCE_RE.finditer(text):
        s, e = m.start(), m.end()
        while s < e and text[s].isspace():
            s += 1
        while e > s and text[e - 1].isspace():
            e -= 1
        if e > s:
            spans.append((s, e))
    return spans


def is_heading(line: str) -> bool:
    """A Markdown heading, a bold or title-like line without a verb's punctuation, or a table rule."""
    text = line.strip()
    if text.startswith("#") or _TABLE_RULE.match(text):
        return True
    if re.fullmatch(r"\*\*[^*]+\*\*:?", text) or text.startswith("="):
        return True
    words = WORD_RE.findall(text)
    # A short line with no sentence end: "Token budget", "Datasets and training".
    return len(words) <= 6 and not re.search(r"[.!]\s*$", text) and not text.startswith("|")


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
    """``text`` with the line breaks inside its paragraphs read as spaces."""
    return _WRAP.sub(lambda m: m.group(1) or " ", text)
