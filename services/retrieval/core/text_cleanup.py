"""Characters and line-end hyphens of extracted text put back the way a reader sees them.

* Typographic ligatures (U+FB00-U+FB06: ﬀ ﬁ ﬂ ﬃ ﬄ ﬅ ﬆ) become their letters and soft hyphens
  (U+00AD) vanish, outside fenced code blocks. Nothing else is normalised: quotes, dashes,
  ellipses, superscripts and full-width forms stay as the document has them (answers quote
  the text, and their quotes are matched against it).
* Words a PDF's typesetter hyphenated at the end of a line are joined again
  (``join_hyphenated``), while compounds that happen to break at their own hyphen keep it.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

_LIGATURE_LETTERS = {
    "\ufb00": "ff",
    "\ufb01": "fi",
    "\ufb02": "fl",
    "\ufb03": "ffi",
    "\ufb04": "ffl",
    "\ufb05": "st",  # long s + t
    "\ufb06": "st",
}
_LIGATURES = str.maketrans(_LIGATURE_LETTERS)
# A soft hyphen only ever marks where a word may be broken: it is never read.
_LIGATURES_AND_SOFT_HYPHENS = str.maketrans({**_LIGATURE_LETTERS, "\u00ad": None})
_FIXED = re.compile("[\ufb00-\ufb06\u00ad]")
# A fenced code block of the parsers' output, fences included.
_FENCE_RE = re.compile(r"^```[^\n]*\n.*?^```[ \t]*$", re.DOTALL | re.MULTILINE)


def fix_characters(text: str, *, soft_hyphens: bool = True) -> str:
    """``text`` with ligatures spelled out and (unless ``soft_hyphens`` is false: a PDF's
    line-end ones are for ``join_hyphenated``) soft hyphens removed, code blocks untouched."""
    if not _FIXED.search(text):
        return text
    table = _LIGATURES_AND_SOFT_HYPHENS if soft_hyphens else _LIGATURES
    out: list[str] = []
    pos = 0
    for m in _FENCE_RE.finditer(text):
        out.append(text[pos : m.start()].translate(table))
        out.append(m.group(0))
        pos = m.end()
    out.append(text[pos:].translate(table))
    return "".join(out)


# A word as evidence counts it: letters and digits, with inner hyphens ("read-only").
_WORD = r"\w+(?:[-\u2010]\w+)*"
_WORD_RE = re.compile(_WORD)
# A line that ends in a word and a hyphen (or a soft hyphen) ...
_HEAD_RE = re.compile(rf"({_WORD})([-\u2010\u00ad])$")
# ... and a line that begins with the rest of it (and what clings to it: "ulated,").
_TAIL_RE = re.compile(rf"^(\s*)({_WORD})(\S*)")


@dataclass(frozen=True)
class _Break:
    """A line that may end in a hyphenated word: ``lines[page][line]`` ends with the hyphen,
    and the next line (``lines[page2][line2]``: the same page's next line, or the next page's
    first) begins with the rest."""

    page: int
    line: int
    page2: int
    line2: int
    head: str  # the word before the hyphen ("command-line" in "command-line-")
    hyphen: str
    tail: str  # the word the next line begins with


def _vocabulary(lines: list[list[str]], breaks: list[_Break]) -> Counter[str]:
    """How often each word, each part of a hyphenated word and each hyphenated pair occurs in
    the document (lower case), leaving out the pieces of the line-end breaks themselves."""
    skip_last = {(b.page, b.line) for b in breaks}
    skip_first = {(b.page2, b.line2) for b in breaks}
    vocab: Counter[str] = Counter()
    for p, page in enumerate(lines):
        for n, line in enumerate(page):
            words = _WORD_RE.findall(line)
            if (p, n) in skip_first:
                words = words[1:]
            if (p, n) in skip_last:
                words = words[:-1]
            for word in words:
                low = word.lower()
                vocab[low] += 1
                parts = re.split(r"[-\u2010]", low)
                if len(parts) > 1:
                    vocab.update(parts)
                    vocab.update(f"{a}-{b}" for a, b in itertools.pairwise(parts))
    return vocab


def _join_decision(head: str, tail: str, vocab: Counter[str]) -> bool:
    """Whether ``head``-``tail`` is one word broken by the typesetter (join) rather than a
    compound that broke at its hyphen (keep). See ``join_hyphenated``."""
    a = re.split(r"[-\u2010]", head)[-1]
    b = re.split(r"[-\u2010]", tail)[0]
    joined, hyphenated = vocab[(a + b).lower()], vocab[f"{a}-{b}".lower()]
    if joined != hyphenated:
        return joined > hyphenated
    if len(a) < 2 or len(b) < 2:
        return False  # typesetters leave two letters at least on each side: "x-axis", "e-mail"
    if not (a.isalpha() and b.isalpha() and b.islower() and (a.islower() or a.istitle())):
        return False  # "X-Window", "x86-64", "Type-1", "GNU-style": names, versions, codes
    a, b = a.lower(), b.lower()
    # Two words the document uses on their own ("time" and "consuming", "Unix" and "like"): a
    # compound. Short pieces ("in", "re") are too often also words to tell.
    return not (len(a) > 2 and len(b) > 2 and vocab[a] > 0 and vocab[b] > 0)


Keep = Callable[[int, str, str], bool]


def _find_breaks(lines: list[list[str]], keep: Keep) -> list[_Break]:
    breaks: list[_Break] = []
    for p, page in enumerate(lines):
        for n, line in enumerate(page):
            m = _HEAD_RE.search(line.rstrip())
            if m is None or not m.group(1)[-1].isalpha():
                continue  # "5.10.0-6-", "--": no word broken here
            if n + 1 < len(page):
                p2, n2 = p, n + 1
            elif p + 1 < len(lines) and lines[p + 1]:
                p2, n2 = p + 1, 0  # the word goes on at the top of the next page
            else:
                continue
            t = _TAIL_RE.match(lines[p2][n2])
            if t is None or not t.group(2)[0].isalpha():
                continue
            if keep(p, line, m.group(1) + m.group(2)) or keep(p2, lines[p2][n2], t.group(2)):
                continue
            breaks.append(_Break(p, n, p2, n2, m.group(1), m.group(2), t.group(2)))
    return breaks


def _never(_page: int, _line: str, _word: str) -> bool:
    return False


def join_hyphenated(pages: list[str], keep: Keep = _never) -> list[str]:
    """``pages`` (each a page's text, lines split by ``\\n``) with the words hyphenated at a line
    end joined: "manip-" / "ulated, and" becomes "manipulated," / "and". The rest of the word
    moves up to the line where it starts (to the previous page for a word broken across pages),
    so every line and page keeps its place; a line left empty by the move is removed.

    Which line-end hyphens are a typesetter's, and which belong to the word ("command-line",
    "read-only", "X-Window"), is decided by the document itself first:

    1. a soft hyphen (U+00AD) at a line end is always the typesetter's: join;
    2. if the document writes the joined word ("manipulated") more often than the hyphenated
       one ("manip-ulated") elsewhere, join; if the hyphenated one more often, keep the hyphen;
    3. with no evidence either way, keep the hyphen
       - when a piece is one letter ("x-axis", "e-mail"): typesetters leave two at least;
       - unless both pieces are plain words, lower-case or (the first) capitalised like a
         sentence's first word: a capital inside, a digit or an underscore marks a name, a
         version or a code ("X-Window", "GNU-style", "x86-64", "Type-1");
       - when both pieces, of three letters or more, are words of their own elsewhere in the
         document ("time" and "consuming": "time-consuming"; "Unix" and "like");
       and otherwise join ("manip-" "ulated", "Eng-" "lish").

    Only a word that ends a line in a letter and a line that begins with a letter are looked
    at. A break is left alone where ``keep(page index, line, word)`` is true for either line
    (with the word that ends it, hyphen included, or the word that begins it): code, headings.
    """
    lines, emptied = join_hyphenated_lines([page.split("\n") for page in pages], keep)
    return [
        "\n".join(ln for n, ln in enumerate(page) if (p, n) not in emptied) for p, page in enumerate(lines)
    ]


def join_hyphenated_lines(
    lines: list[list[str]], keep: Keep = _never
) -> tuple[list[list[str]], set[tuple[int, int]]]:
    """``join_hyphenated`` on pages given as lists of lines: the lines after the joins (as many
    as before: a line whose text all moved up is ``""``) and the (page, line) of those emptied
    by a move, for a caller that keeps track of where each line stands."""
    lines = [list(page) for page in lines]
    breaks = _find_breaks(lines, keep)
    if not breaks:
        return lines, set()
    vocab = _vocabulary(lines, breaks)
    emptied: set[tuple[int, int]] = set()
    # Last to first: a line that is both the rest of one word and the start of another
    # gives its first word away after its own end is settled.
    for b in reversed(breaks):
        if b.hyphen != "\u00ad" and not _join_decision(b.head, b.tail, vocab):
            continue
        upper, lower = lines[b.page][b.line], lines[b.page2][b.line2]
        t = _TAIL_RE.match(lower)
        if t is None or t.group(2) != b.tail or (b.page2, b.line2) in emptied:
            continue  # the line was changed by a later break: leave it
        lines[b.page][b.line] = upper.rstrip()[:-1] + t.group(2) + t.group(3)
        lines[b.page2][b.line2] = lower[t.end() :].lstrip()
        if not lines[b.page2][b.line2]:
            emptied.add((b.page2, b.line2))
    return lines, emptied
