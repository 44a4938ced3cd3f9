"""Token-aware recursive chunking with overlap that respects Markdown headings: the one set of
cutting rules for the retrieval service's chunks and the trainer's passages (generated queries).

1. The text is cut into sections at Markdown ATX headings (``# ...`` to ``###### ...``,
   outside code fences). A chunk never spans two sections, and each chunk carries its
   heading path (``Guide > Install``) as context that is indexed with it.
2. Within a section, tokens are counted with the embedding model's own tokenizer. A
   chunk takes at most ``size`` tokens; if the section goes on, the cut moves back to the
   strongest separator in the second half of the window, in order: paragraph break,
   line break, sentence end, clause punctuation, space (the recursive-splitter order,
   applied to token windows so the size limit holds exactly).
3. The next chunk starts up to ``overlap`` tokens before the cut, moved forward to the
   start of a word, so overlapping text never begins mid-word.

Every chunk's text is exactly ``text[start:end]``.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable
from dataclasses import dataclass

Offsets = Callable[[str], list[tuple[int, int]]]

HEADING_RE = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t#]*$")
FENCE_RE = re.compile(r"^ {0,3}(```|~~~)")
SEPARATORS = ("\n\n", "\n", ". ", "? ", "! ", "; ", ": ", ", ", " ")
_WORD_RE = re.compile(r"\S+")


def regex_offsets(text: str) -> list[tuple[int, int]]:
    """A model-free token counter (whitespace words), for tests and tools without a model."""
    return [(m.start(), m.end()) for m in _WORD_RE.finditer(text)]


@dataclass(frozen=True)
class Section:
    start: int
    end: int
    headings: tuple[str, ...]


def sections(text: str) -> list[Section]:
    """Split at Markdown headings; a heading with no body before the next heading stays with it."""
    bounds: list[tuple[int, int, str]] = []  # (offset, level, title)
    pos = 0
    in_fence = False
    for line in text.splitlines(keepends=True):
        stripped = line.rstrip("\r\n")
        if FENCE_RE.match(stripped):
            in_fence = not in_fence
        elif not in_fence:
            m = HEADING_RE.match(stripped)
            if m:
                bounds.append((pos, len(m.group(1)), m.group(2).strip()))
        pos += len(line)
    out: list[Section] = []
    first = bounds[0][0] if bounds else len(text)
    if text[:first].strip():
        out.append(Section(0, first, ()))
    stack: list[tuple[int, str]] = []
    pending: int | None = None
    for i, (off, level, title) in enumerate(bounds):
        while stack and stack[-1][0] >= level:
            stack.pop()
        stack.append((level, title))
        end = bounds[i + 1][0] if i + 1 < len(bounds) else len(text)
        nl = text.find("\n", off, end)
        body = text[nl + 1 : end] if nl >= 0 else ""
        if not body.strip() and i + 1 < len(bounds):
            # A heading with no body of its own leads the next section instead of being a chunk.
            pending = off if pending is None else pending
            continue
        out.append(Section(off if pending is None else pending, end, tuple(t for _, t in stack)))
        pending = None
    return out


def _split_tokens(text: str, toks: list[tuple[int, int]], size: int, overlap: int) -> list[tuple[int, int]]:
    """Token windows [i, j) over ``toks`` following the rules in the module docstring."""
    n = len(toks)
    starts = [t[0] for t in toks]
    out: list[tuple[int, int]] = []
    i = 0
    while i < n:
        j = min(i + size, n)
        if j < n:
            lo = starts[i + max(1, size // 2)]
            hi = starts[j]
            cut = -1
            for sep in SEPARATORS:
                p = text.rfind(sep, lo, hi)
                if p >= 0:
                    cut = p + len(sep)
                    break
            if cut > 0:
                jj = bisect.bisect_left(starts, cut, i + 1, j)
                j = max(jj, i + 1)
        out.append((i, j))
        if j >= n:
            break
        k = max(j - overlap, i + 1)
        # Start the overlap at a word start.
        while k < j and starts[k] > 0 and not text[starts[k] - 1].isspace():
            k += 1
        i = k
    return out


def chunk_text(
    text: str,
    *,
    size: int,
    overlap: int,
    offsets: Offsets = regex_offsets,
) -> list[tuple[int, int, tuple[str, ...]]]:
    """(start, end, heading path) of each chunk of ``text``."""
    if overlap >= size:
        raise ValueError(f"chunk overlap ({overlap}) must be smaller than the chunk size ({size})")
    all_toks = offsets(text)
    tok_starts = [t[0] for t in all_toks]
    out: list[tuple[int, int, tuple[str, ...]]] = []
    for sec in sections(text):
        a = bisect.bisect_left(tok_starts, sec.start)
        b = bisect.bisect_left(tok_starts, sec.end)
        toks = [t for t in all_toks[a:b] if t[1] > t[0]]
        if not toks:
            continue
        for i, j in _split_tokens(text, toks, size, overlap):
            start, end = toks[i][0], min(toks[j - 1][1], sec.end)
            if text[start:end].strip():
                out.append((start, end, sec.headings))
    return out
