"""Training rows of the answer reader, from the FAQ pages of Debian documentation packages.

The reader is a cross-encoder: given a question and one candidate sentence of a document (with
the heading path of that sentence's section), it scores whether the sentence answers the
question. Its training data are real human-written questions and answers: the FAQs of four
documentation packages, unpacked under ``DIR/<package>/`` by ``python -m benchmarks.answers.fetch``
(other packages there are kept for evaluation and are never read here):

- ``perl-doc``: ``perlfaq1`` … ``perlfaq9`` (POD: ``=head2`` questions under ``=head1`` topics);
- ``python3.11-doc``: the Python FAQ's HTML pages (``html/faq/*.html``);
- ``debian-faq``: the Debian FAQ's HTML chapters;
- ``git-doc``: ``gitfaq.html`` (questions are the terms of definition lists).

**Entries.** Each document becomes a flow of headings and text paragraphs (POD verbatim
paragraphs and HTML ``<pre>`` blocks are code: they are left out; list items and definition
terms are paragraphs of their own; navigation, tables of contents and footnotes are dropped).
A heading that reads as a question opens an entry: it holds a "?", opens with an interrogative
word ("How", "Can", "Is", …), or states a problem (at least four words, in the first person or
ending in "."); an HTML definition term that reads as a question does too. Its answer is every
paragraph up to the next heading of the same or a higher level, including the text of
sub-sections whose headings are not questions (they elaborate the answer); a paragraph wholly
in parentheses or brackets is an aside (an attribution such as "(contributed by …)"), not
answer text. An entry's ``context`` is the heading path above its question (document title,
then section headings; section numbers dropped), never the question itself. Entries whose
answer has no usable sentence are dropped.

**Sentences.** A paragraph is split where ".", "!" or "?" (optionally followed by a closing
quote or bracket) is followed by white space and then a capital letter, a digit, an opening
quote or bracket, or inline code. So ``list.sort()``, ``.deb``, ``5.004`` and ``--foo`` stay
whole (no space after their dots), inline code is never split (its span is masked while the
boundaries are found), and a dot after a known abbreviation ("e.g.", "i.e.", "cf.", "vs.") or
a single capital initial ("A. U. Thor") ends no sentence. A sentence is usable when it has a
word of two letters or more once URLs are removed.

**Labels.** For every entry (its answer's usable sentences ``s1, s2, …``):

- positive (label 1): ``s1``, the opening of the answer; and ``s2`` as well when ``s1`` is
  short (fewer than 8 words: "Yes.", "It depends."), ends with ":" (it introduces what
  follows), or merely restates the question (at least 60% of its content words are the
  question's);
- hard negatives (label 0): the 3 sentences of *other* entries of the same package most
  similar to the question (cosine of IDF-weighted word sets, IDF over the package's
  sentences), skipping entries whose question is itself similar to this one (cosine ≥ 0.5:
  a near-duplicate question may share its answer) and any sentence identical to one of this
  answer's;
- one random sentence of another entry of the same package (label 0);
- up to 2 sentences of the same answer from its 4th sentence on (label 0): elaborations, not
  the answer.

Negatives have at least 5 words, so that a fragment ("Using pack:") never stands for one.
Choices are seeded per entry (``seed`` plus the entry's identity), so a build is deterministic;
rows are deduplicated on (group, context, question, sentence), a positive winning over a
negative.

**Rows.** JSONL lines ``{"question", "sentence", "context", "label", "source", "group"}``:
``source`` is the package, ``group`` the FAQ document ("perlfaq4", "python-faq/programming",
"debian-faq", "gitfaq"), so training can hold out whole documents.

Run as ``tandem reader dataset [--docs DIR] [--out FILE]`` (or ``python -m
services.trainer.data.faq``): the rows go to ``FILE`` (gzip when it ends in ``.gz``, with no
time stamp so a rebuild is byte-identical) or stdout, and a one-line summary to stderr.
"""

from __future__ import annotations

import argparse
import gzip
import html
import json
import math
import os
import random
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from bs4 import BeautifulSoup, NavigableString, Tag
from bs4.element import Comment, Declaration, Doctype, ProcessingInstruction

PACKAGES = ("perl-doc", "python3.11-doc", "debian-faq", "git-doc")
FETCH_COMMAND = "python -m benchmarks.answers.fetch"

# Inline code is wrapped in these private-use characters while a paragraph is split, so no
# boundary is ever found inside it; they never reach an entry or a row.
CODE_OPEN, CODE_CLOSE = "\ue000", "\ue001"

SHORT_FIRST_WORDS = 8  # a first sentence shorter than this needs the second to answer
RESTATES_SHARE = 0.6  # content words of the first sentence found in the question
SIMILAR_QUESTION = 0.5  # question cosine above which another entry may share the answer
NEGATIVE_MIN_WORDS = 5
HARD_NEGATIVES = 3
TAIL_FROM = 3  # 0-based: the 4th sentence on
TAIL_NEGATIVES = 2


class FaqDocsError(FileNotFoundError):
    """The documentation packages are not where they are looked for."""


@dataclass(frozen=True)
class FaqEntry:
    """One question of a FAQ and its answer: ``answer_paragraphs`` as plain text, and the usable
    ``sentences`` they split into (code blocks excluded)."""

    question: str
    answer_paragraphs: tuple[str, ...]
    context: str
    source: str
    group: str
    sentences: tuple[str, ...]


@dataclass(frozen=True)
class ReaderRow:
    """A training row of the reader: does ``sentence`` (under ``context``) answer ``question``?"""

    question: str
    sentence: str
    context: str
    label: int
    source: str
    group: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Para:
    text: str  # inline code between CODE_OPEN and CODE_CLOSE


Flow = list[Heading | Para]


# ---------------------------------------------------------------- text and sentences

_ABBREVIATIONS = {"e.g", "eg", "i.e", "ie", "cf", "vs", "viz", "approx", "esp", "resp", "incl", "al"}
_ABBREVIATIONS |= {"mr", "mrs", "ms", "dr", "prof", "fig"}
_BOUNDARY = re.compile(r"[.!?]+[\"'”’)\]]*\s+(?=[A-Z0-9\"'“‘(\[" + CODE_OPEN + "])")
_CODE_SPAN = re.compile(CODE_OPEN + "[^" + CODE_CLOSE + "]*" + CODE_CLOSE)
_URL = re.compile(r"\b(?:https?|ftp)://\S+|\bwww\.\S+")
_NUMBERING = re.compile(r"^(?:(?:Chapter|Appendix|Section)\s+[0-9A-Z]+\.?\s+|\d+(?:\.\d+)*\.?\s+(?=\S))")
_QUESTION_WORDS = frozenset(
    [
        "how",
        "what",
        "why",
        "when",
        "where",
        "which",
        "who",
        "whom",
        "whose",
        "can",
        "could",
        "should",
        "shall",
        "will",
        "would",
        "is",
        "are",
        "am",
        "was",
        "were",
        "do",
        "does",
        "did",
        "has",
        "have",
        "may",
        "must",
        "might",
    ]
)
# a heading in the first person states a user's problem ("I asked Git to ignore …, yet …")
_FIRST_PERSON = {"i", "im", "ive", "id", "my", "we"}


def plain(text: str) -> str:
    """``text`` without code marks, its white space collapsed."""
    return " ".join(text.replace(CODE_OPEN, "").replace(CODE_CLOSE, "").split())


def _ends_sentence(text: str, dot: int) -> bool:
    """Whether the punctuation at ``dot`` closes a sentence: not after an abbreviation or an
    initial."""
    if text[dot] != ".":
        return True
    word = text[:dot].rsplit(None, 1)[-1] if text[:dot].strip() else ""
    word = word.lstrip("(\"'“‘[")
    if word.lower() in _ABBREVIATIONS:
        return False
    return not (len(word) == 1 and word.isupper())


def split_sentences(paragraph: str) -> list[str]:
    """The sentences of one paragraph (code marks kept; see the module's rule)."""
    # The same string with every code span's inside blanked: boundaries are searched there.
    masked = _CODE_SPAN.sub(lambda m: CODE_OPEN + "x" * (len(m.group()) - 2) + CODE_CLOSE, paragraph)
    out, start = [], 0
    for m in _BOUNDARY.finditer(masked):
        if _ends_sentence(masked, m.start()):
            out.append(paragraph[start : m.end()].strip())
            start = m.end()
    out.append(paragraph[start:].strip())
    return [s for s in out if s]


def usable(sentence: str) -> bool:
    return re.search(r"[A-Za-z]{2}", _URL.sub(" ", sentence)) is not None


def words(text: str) -> int:
    """Words of ``text``: white-space separated pieces holding a letter or digit ("-" is none)."""
    return sum(1 for piece in text.split() if re.search(r"\w", piece))


def is_question(heading: str) -> bool:
    """Whether a heading reads as a question (see the module's rule)."""
    text = heading.strip()
    if not text:
        return False
    if "?" in text:
        return True
    first = re.sub(r"[^a-z]", "", text.split()[0].lower())
    if first in _QUESTION_WORDS or (first in _FIRST_PERSON and words(text) >= 4):
        return True
    return text.endswith(".") and words(text) >= 4


def clean_heading(text: str) -> str:
    return _NUMBERING.sub("", plain(text)).strip()


def _is_aside(paragraph: str) -> bool:
    """A paragraph wholly in one pair of parentheses or brackets: a remark or an attribution."""
    text = plain(paragraph)
    for left, right in ("()", "[]"):
        inner = text[1:-1]
        if text[:1] == left and text[-1:] == right and inner.count(left) == inner.count(right):
            return True
    return False


# ---------------------------------------------------------------- flow -> entries


@dataclass
class _Open:
    level: int
    text: str
    entry: int | None  # index into the pending entries when this heading is a question


def entries_from_flow(flow: Flow, source: str, group: str) -> list[FaqEntry]:
    """The FAQ entries of one document's flow (see the module's rule)."""
    stack: list[_Open] = []
    pending: list[tuple[str, str, list[str]]] = []  # question, context, paragraphs
    for event in flow:
        if isinstance(event, Heading):
            while stack and stack[-1].level >= event.level:
                stack.pop()
            index = None
            if is_question(event.text):
                context = " > ".join(o.text for o in stack if o.text)
                index = len(pending)
                pending.append((event.text, context, []))
            stack.append(_Open(event.level, event.text, index))
            continue
        owner = next((o.entry for o in reversed(stack) if o.entry is not None), None)
        if owner is not None and not _is_aside(event.text):
            pending[owner][2].append(event.text)
    entries = []
    for question, context, paragraphs in pending:
        sentences = tuple(plain(s) for p in paragraphs for s in split_sentences(p))
        sentences = tuple(s for s in sentences if usable(s))
        if sentences:
            clean = tuple(plain(p) for p in paragraphs)
            entries.append(FaqEntry(question, clean, context, source, group, sentences))
    return entries


# ---------------------------------------------------------------- POD


_POD_STANDARD = {"NAME", "SYNOPSIS", "DESCRIPTION", "VERSION", "AUTHOR", "AUTHORS", "SEE ALSO"}
_POD_STANDARD |= {"COPYRIGHT", "LICENSE", "AUTHOR AND COPYRIGHT", "COPYRIGHT AND LICENSE"}
_POD_ENTITIES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/", "quot": '"', "amp": "&", "apos": "'"}
_POD_CODE = re.compile(r"([A-Z])(<+)")


def _pod_close(text: str, start: int, opens: int) -> tuple[int, int] | None:
    """(end of the inside, end of the code) of a formatting code whose inside starts at
    ``start``: ``X<< … >>`` closes at white space and as many ``>``; ``X<…>`` at the ``>``
    that balances nested codes."""
    if opens > 1:
        m = re.compile(r"\s" + ">" * opens).search(text, start)
        return (m.start(), m.end()) if m else None
    depth, i = 1, start
    while i < len(text):
        if _POD_CODE.match(text, i):
            depth, i = depth + 1, i + 2
            continue
        if text[i] == ">":
            depth -= 1
            if depth == 0:
                return i, i + 1
        i += 1
    return None


def _pod_link(inside: str) -> str:
    """The text ``L<…>`` shows: its own text, a URL, or '"section" in page'."""
    if "|" in inside:
        return pod_inline(inside.split("|", 1)[0])
    target = pod_inline(inside)
    if re.match(r"\w+://", target):
        return target
    page, _, section = target.partition("/")
    section = section.strip('"')
    if section:
        return f'"{section}" in {page}' if page else f'"{section}"'
    return page


def _pod_code(letter: str, inside: str) -> str:
    if letter == "C":
        return CODE_OPEN + plain(pod_inline(inside)) + CODE_CLOSE
    if letter == "L":
        return _pod_link(inside)
    if letter == "E":
        name = inside.strip()
        if name.isdigit() or name.lower().startswith("0x"):
            return chr(int(name, 0))
        return _POD_ENTITIES.get(name) or html.unescape(f"&{name};")
    if letter in "XZ":
        return ""  # index entries and null codes show nothing
    return pod_inline(inside)  # B, I, F, S: emphasis, file names, non-breaking: the text


def pod_inline(text: str) -> str:
    """A POD paragraph's text with its formatting codes rendered (inline code marked)."""
    out, i = [], 0
    while i < len(text):
        m = _POD_CODE.match(text, i)
        if not m:
            out.append(text[i])
            i += 1
            continue
        opens = len(m.group(2))
        if opens > 1 and not text[m.end() : m.end() + 1].isspace():
            opens = 1  # "C<<=>": one bracket, the rest is text
        start = i + 2 if opens == 1 else m.end()
        closed = _pod_close(text, start, opens)
        if closed is None:
            out.append(text[i])
            i += 1
            continue
        out.append(
            _pod_code(m.group(1), text[start : closed[0]].strip() if opens > 1 else text[start : closed[0]])
        )
        i = closed[1]
    return "".join(out)


def _pod_paragraphs(text: str) -> Iterator[str]:
    """The paragraphs of a POD file's POD blocks (code between ``=cut`` and the next command
    is skipped)."""
    inside = False
    for raw in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")):
        para = raw.strip("\n")
        if not para.strip():
            continue
        if para.startswith("="):
            inside = not para.startswith("=cut")
        if inside:
            yield para


def pod_flow(text: str) -> Flow:
    """A POD document as headings and text paragraphs: ``NAME``'s line is the title (level 0),
    ``=headN`` a heading of level N (POD's standard sections name no topic: empty headings),
    ``=item`` text a paragraph; verbatim (indented) paragraphs and ``=begin``/``=for`` blocks
    are left out."""
    flow: Flow = []
    in_begin = want_title = False
    for para in _pod_paragraphs(text):
        if para.startswith("="):
            command, *more = para.split(None, 1)
            rest = more[0].strip() if more else ""
            if in_begin:
                in_begin = command != "=end"
            elif command == "=begin":
                in_begin = True
            elif re.fullmatch(r"=head[1-6]", command):
                title = " ".join(pod_inline(rest).split())
                want_title = title == "NAME"
                flow.append(Heading(int(command[-1]), "" if title in _POD_STANDARD else title))
            elif command == "=item":
                item = re.sub(r"^(?:\*|\d+\.?)\s*", "", rest)
                if item:
                    flow.append(Para(pod_inline(item)))
        elif in_begin or para[0] in " \t":
            continue  # a verbatim paragraph is code
        elif want_title:
            flow.append(Heading(0, plain(pod_inline(para))))
            want_title = False
        else:
            flow.append(Para(pod_inline(para)))
    return flow


# ---------------------------------------------------------------- HTML


_SKIP_TAGS = {"script", "style", "noscript", "template", "head", "nav", "pre", "form", "button", "select"}
# navigation, tables of contents, footnotes (and their "[1]" marks) and permalinks are no answer text
_SKIP_CLASSES = {
    "toc",
    "navheader",
    "navfooter",
    "footnote",
    "footnotes",
    "sphinxsidebar",
    "related",
    "footer",
}
_SKIP_CLASSES |= {"headerlink", "admonition-title", "toctree-wrapper", "indexterm"}
_ADMONITIONS = {"note", "warning", "tip", "caution", "important", "admonition", "seealso", "sidebar"}
_CODE_TAGS = {"code", "tt", "kbd", "samp"}
_INLINE_TAGS = _CODE_TAGS | frozenset(
    [
        "a",
        "abbr",
        "acronym",
        "b",
        "bdi",
        "bdo",
        "big",
        "br",
        "cite",
        "data",
        "del",
        "dfn",
        "em",
        "font",
        "i",
        "img",
        "ins",
        "mark",
        "q",
        "s",
        "small",
        "span",
        "strike",
        "strong",
        "sub",
        "sup",
        "time",
        "u",
        "var",
        "wbr",
    ]
)


def _classes(tag: Tag) -> set[str]:
    value = tag.get("class")
    if isinstance(value, str):
        return set(value.split())
    return set(value or ())


def _skipped(tag: Tag) -> bool:
    return tag.name in _SKIP_TAGS or bool(_classes(tag) & _SKIP_CLASSES)


def _text_nodes(node: NavigableString) -> bool:
    return not isinstance(node, Comment | Declaration | Doctype | ProcessingInstruction)


def html_inline(tag: Tag) -> str:
    """An inline element's text, inline code marked."""
    if tag.name in _CODE_TAGS:
        return CODE_OPEN + " ".join(tag.get_text().split()) + CODE_CLOSE
    if tag.name == "br":
        return " "
    parts = []
    for child in tag.children:
        if isinstance(child, NavigableString):
            if _text_nodes(child):
                parts.append(str(child))
        elif isinstance(child, Tag) and not _skipped(child):
            parts.append(html_inline(child))
    return "".join(parts)


class _HtmlFlow:
    """Walks an HTML tree into a flow: headings, and a paragraph for every run of inline text
    between block elements."""

    def __init__(self) -> None:
        self.flow: Flow = []
        self.buffer: list[str] = []
        self.level = 0

    def flush(self) -> None:
        text = " ".join("".join(self.buffer).split())
        self.buffer = []
        if plain(text):
            self.flow.append(Para(text))

    def heading(self, level: int, text: str) -> None:
        self.flush()
        self.level = level
        self.flow.append(Heading(level, clean_heading(text)))

    def walk(self, node: Tag, in_admonition: bool = False) -> None:
        for child in node.children:
            if isinstance(child, NavigableString):
                if _text_nodes(child):
                    self.buffer.append(str(child))
            elif not isinstance(child, Tag) or _skipped(child):
                continue
            elif re.fullmatch(r"h[1-6]", child.name):
                # an admonition's own heading is its label ("Note"), not a section
                if in_admonition:
                    self.flush()
                else:
                    self.heading(int(child.name[1]), html_inline(child))
            elif child.name in _INLINE_TAGS:
                self.buffer.append(html_inline(child))
            elif child.name == "dl":
                self.definitions(child, in_admonition)
            else:
                self.flush()
                self.walk(child, in_admonition or bool(_classes(child) & _ADMONITIONS))
                self.flush()

    def definitions(self, dl: Tag, in_admonition: bool) -> None:
        """A definition list: a term that reads as a question is a heading one level below the
        current section's (its definition, the answer); any other term is a paragraph."""
        self.flush()
        base, asked = self.level, False
        for child in dl.find_all(["dt", "dd"], recursive=False):
            term = plain(html_inline(child)) if child.name == "dt" else ""
            if child.name == "dt" and is_question(term) and not in_admonition:
                self.heading(base + 1, term)
                asked = True
            elif child.name == "dt":
                self.buffer.append(html_inline(child))
                self.flush()
            else:
                self.walk(child, in_admonition)
                self.flush()
        if asked:
            # close the last question: what follows the list is no longer its answer
            self.heading(base + 1, "")
            self.level = base


def html_flow(source: str) -> Flow:
    """An HTML page as headings and text paragraphs (code blocks, navigation and tables of
    contents left out), from its main content when it marks one."""
    soup = BeautifulSoup(source, "html.parser")
    main = soup.find(role="main") or soup.body or soup
    walker = _HtmlFlow()
    if isinstance(main, Tag):
        walker.walk(main)
    walker.flush()
    return walker.flow


# ---------------------------------------------------------------- the packages


@dataclass(frozen=True)
class FaqDocument:
    path: Path
    group: str
    kind: str  # "pod" or "html"


def _files(root: Path, pattern: str) -> list[Path]:
    """The files matching ``pattern`` under ``root``, each once: packages link one file under
    several names (Debian's ``x.html`` -> ``x.en.html``, ``python3.11-doc/html`` ->
    ``python3.11/html``)."""
    return sorted({p.resolve() for p in root.glob(pattern) if p.is_file()})


def _perl_documents(root: Path) -> list[FaqDocument]:
    return [FaqDocument(p, p.stem, "pod") for p in _files(root, "usr/share/perl/*/pod/perlfaq[1-9].pod")]


def _python_documents(root: Path) -> list[FaqDocument]:
    paths = _files(root, "usr/share/doc/python3*/html/faq/*.html")
    return [FaqDocument(p, f"python-faq/{p.stem}", "html") for p in paths if p.stem != "index"]


def _debian_documents(root: Path) -> list[FaqDocument]:
    return [FaqDocument(p, "debian-faq", "html") for p in _files(root, "usr/share/doc/debian/FAQ/*.html")]


def _git_documents(root: Path) -> list[FaqDocument]:
    return [FaqDocument(p, "gitfaq", "html") for p in _files(root, "usr/share/doc/git-doc/gitfaq.html")]


FINDERS: dict[str, Callable[[Path], list[FaqDocument]]] = {
    "perl-doc": _perl_documents,
    "python3.11-doc": _python_documents,
    "debian-faq": _debian_documents,
    "git-doc": _git_documents,
}


def default_docs_dir() -> Path:
    return Path(os.environ.get("TANDEM_ANSWER_DOCS") or Path.home() / ".cache" / "tandem" / "answer-docs")


def find_documents(docs: Path) -> dict[str, list[FaqDocument]]:
    """Every package's FAQ documents under ``docs``; a missing package raises ``FaqDocsError``
    naming it and the command that fetches it."""
    found = {package: FINDERS[package](docs / package) for package in PACKAGES}
    missing = [package for package, documents in found.items() if not documents]
    if missing:
        where = "no such directory" if not docs.is_dir() else "not unpacked there"
        raise FaqDocsError(
            f"FAQ package(s) {', '.join(missing)} missing under {docs} ({where}); fetch them with "
            f"`{FETCH_COMMAND} --dest {docs} {' '.join(missing)}` (after `apt-get update`)"
        )
    return found


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def load_entries(docs: Path) -> list[FaqEntry]:
    """The FAQ entries of the four packages under ``docs``, in package then document order."""
    entries: list[FaqEntry] = []
    for package, documents in find_documents(docs).items():
        for document in documents:
            text = read_text(document.path)
            flow = pod_flow(text) if document.kind == "pod" else html_flow(text)
            entries += entries_from_flow(flow, package, document.group)
    return entries


# ---------------------------------------------------------------- labels


_STOPWORDS = frozenset(
    [
        "a",
        "an",
        "the",
        "and",
        "or",
        "but",
        "if",
        "then",
        "else",
        "of",
        "to",
        "in",
        "on",
        "at",
        "by",
        "for",
        "with",
        "from",
        "into",
        "onto",
        "as",
        "is",
        "are",
        "was",
        "were",
        "be",
        "been",
        "being",
        "am",
        "do",
        "does",
        "did",
        "done",
        "have",
        "has",
        "had",
        "having",
        "i",
        "me",
        "my",
        "we",
        "our",
        "you",
        "your",
        "he",
        "she",
        "it",
        "its",
        "they",
        "them",
        "their",
        "this",
        "that",
        "these",
        "those",
        "there",
        "here",
        "what",
        "which",
        "who",
        "whom",
        "whose",
        "when",
        "where",
        "why",
        "how",
        "can",
        "could",
        "should",
        "would",
        "will",
        "shall",
        "may",
        "might",
        "must",
        "not",
        "no",
        "nor",
        "so",
        "than",
        "too",
        "very",
        "just",
        "also",
        "only",
        "about",
        "any",
        "some",
        "all",
        "each",
        "every",
        "more",
        "most",
        "other",
        "such",
        "own",
        "same",
        "both",
        "few",
        "s",
        "t",
        "don",
        "doesn",
        "isn",
        "aren",
        "get",
        "got",
        "use",
        "used",
        "using",
        "way",
        "want",
        "need",
        "one",
        "make",
        "like",
    ]
)


def tokens(text: str) -> set[str]:
    """Content words of ``text``: lower case, stop words out, a plural "s" dropped."""
    out = set()
    for word in re.findall(r"[a-z0-9_]+", text.lower()):
        if len(word) < 2 or word in _STOPWORDS:
            continue
        if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
            word = word[:-1]
        out.add(word)
    return out


def positives(entry: FaqEntry) -> list[str]:
    """The sentences of ``entry``'s answer that answer it (see the module's rule)."""
    first = entry.sentences[0]
    out = [first]
    if len(entry.sentences) > 1:
        own = tokens(first)
        restates = bool(own) and len(own & tokens(entry.question)) >= RESTATES_SHARE * len(own)
        if words(first) < SHORT_FIRST_WORDS or first.endswith(":") or restates:
            out.append(entry.sentences[1])
    return out


class _Index:
    """IDF-weighted word sets of a package's sentences and questions, and an inverted index of
    the sentences, for cosine similarity."""

    def __init__(self, entries: Sequence[FaqEntry]) -> None:
        self.entries = entries
        # (entry index, sentence) for every sentence long enough to be a negative
        self.sentences = [
            (i, s)
            for i, e in enumerate(entries)
            for s in dict.fromkeys(e.sentences)
            if words(s) >= NEGATIVE_MIN_WORDS
        ]
        self.words = [tokens(s) for _, s in self.sentences]
        df = Counter(t for ws in self.words for t in ws)
        n = len(self.sentences)
        # a word no sentence has (a question's own) weighs as the rarest
        self.idf: dict[str, float] = defaultdict(lambda: math.log(n + 1) + 1.0)
        self.idf.update({t: math.log((n + 1) / (c + 1)) + 1.0 for t, c in df.items()})
        self.norms = [self.norm(ws) for ws in self.words]
        self.postings: dict[str, list[int]] = defaultdict(list)
        for k, ws in enumerate(self.words):
            for t in ws:
                self.postings[t].append(k)
        self.questions = [tokens(e.question) for e in entries]

    def norm(self, ws: Iterable[str]) -> float:
        return math.sqrt(sum(self.idf[t] ** 2 for t in ws)) or 1.0

    def cosine(self, a: set[str], b: set[str]) -> float:
        return sum(self.idf[t] ** 2 for t in a & b) / (self.norm(a) * self.norm(b))

    def similar(self, i: int) -> list[tuple[float, int]]:
        """(cosine, sentence number) of every sentence sharing a word with entry ``i``'s
        question, best first (ties in corpus order)."""
        question = self.questions[i]
        scores: dict[int, float] = defaultdict(float)
        for t in question:
            for k in self.postings.get(t, ()):
                scores[k] += self.idf[t] ** 2
        qn = self.norm(question)
        return sorted(((s / (qn * self.norms[k]), k) for k, s in scores.items()), key=lambda x: (-x[0], x[1]))


def _eligible(index: _Index, i: int, k: int, taken: set[str]) -> bool:
    """Whether sentence ``k`` may be a negative of entry ``i``."""
    j, sentence = index.sentences[k]
    if j == i or sentence in taken:
        return False
    return index.cosine(index.questions[i], index.questions[j]) < SIMILAR_QUESTION


def negatives(index: _Index, i: int, rng: random.Random, taken: set[str]) -> list[str]:
    """Entry ``i``'s hard, random and same-answer negatives (see the module's rule); ``taken``:
    the sentences it already has, grown with the ones chosen."""
    chosen: list[str] = []

    def take(sentence: str) -> None:
        chosen.append(sentence)
        taken.add(sentence)

    for _score, k in index.similar(i):
        if len(chosen) == HARD_NEGATIVES:
            break
        if _eligible(index, i, k, taken):
            take(index.sentences[k][1])
    # a random sentence of another entry: a few draws find one (the pool is the whole package)
    for _ in range(50 if index.sentences else 0):
        k = rng.randrange(len(index.sentences))
        if _eligible(index, i, k, taken):
            take(index.sentences[k][1])
            break
    entry = index.entries[i]
    tail = [s for s in dict.fromkeys(entry.sentences[TAIL_FROM:]) if words(s) >= NEGATIVE_MIN_WORDS]
    for sentence in rng.sample(tail, min(TAIL_NEGATIVES, len(tail))):
        if sentence not in taken:
            take(sentence)
    return chosen


def _entry_rows(index: _Index, i: int, seed: int) -> list[ReaderRow]:
    entry = index.entries[i]
    rng = random.Random(f"{seed}|{entry.source}|{entry.group}|{entry.context}|{entry.question}")
    good = positives(entry)
    # identical sentences elsewhere in this answer are never negatives of it
    taken = set(entry.sentences[:TAIL_FROM]) | set(good)
    bad = negatives(index, i, rng, taken)

    def row(sentence: str, label: int) -> ReaderRow:
        return ReaderRow(entry.question, sentence, entry.context, label, entry.source, entry.group)

    return [row(s, 1) for s in good] + [row(s, 0) for s in bad]


def dedupe(rows: Iterable[ReaderRow]) -> list[ReaderRow]:
    """Rows unique on (group, context, question, sentence), first kept, a positive over a
    negative."""
    kept: dict[tuple[str, str, str, str], ReaderRow] = {}
    for row in rows:
        key = (row.group, row.context, row.question, row.sentence)
        if key not in kept or (row.label == 1 and kept[key].label == 0):
            kept[key] = row
    return list(kept.values())


def reader_rows(entries: Sequence[FaqEntry], seed: int = 0) -> list[ReaderRow]:
    """The reader's rows of ``entries`` (negatives drawn within each source)."""
    by_source: dict[str, list[FaqEntry]] = defaultdict(list)
    for entry in entries:
        by_source[entry.source].append(entry)
    rows: list[ReaderRow] = []
    for source_entries in by_source.values():
        index = _Index(source_entries)
        for i in range(len(source_entries)):
            rows += _entry_rows(index, i, seed)
    return dedupe(rows)


# ---------------------------------------------------------------- the command


def summary(entries: Sequence[FaqEntry], rows: Sequence[ReaderRow]) -> str:
    """One line: entries and rows per source, positives and negatives."""
    per_entry = Counter(e.source for e in entries)
    per_row = Counter(r.source for r in rows)
    good = sum(r.label for r in rows)
    parts = [f"{s} {per_entry[s]} entries/{per_row[s]} rows" for s in per_entry]
    return (
        f"reader dataset: {'; '.join(parts)}; {len(rows)} rows: {good} positive, {len(rows) - good} negative"
    )


def write_rows(rows: Iterable[ReaderRow], out: IO[str]) -> None:
    for row in rows:
        out.write(row.to_json() + "\n")


def write_dataset(rows: Sequence[ReaderRow], path: Path | None) -> None:
    """``rows`` as JSONL to ``path`` (gzip, with no time stamp or name in its header, when it
    ends in ``.gz``) or stdout."""
    if path is None:
        write_rows(rows, sys.stdout)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        with path.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
            gz.write("".join(r.to_json() + "\n" for r in rows).encode())
        return
    with path.open("w", encoding="utf-8") as f:
        write_rows(rows, f)


def build(docs: Path, out: Path | None, seed: int = 0) -> str:
    """Builds the dataset from ``docs`` into ``out`` (stdout when None); its summary line."""
    entries = load_entries(docs)
    rows = reader_rows(entries, seed)
    write_dataset(rows, out)
    return summary(entries, rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem reader dataset", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--docs", type=Path, default=None, help="unpacked packages (default $TANDEM_ANSWER_DOCS)"
    )
    parser.add_argument("--out", type=Path, default=None, help="JSONL file (.gz: gzip); default stdout")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        line = build(args.docs or default_docs_dir(), args.out, args.seed)
    except FaqDocsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
