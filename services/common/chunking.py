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
4. Fenced code blocks and tables (runs of ``| ... |`` lines) are kept whole: a cut that would
   fall inside one moves back to its start, and an overlap never starts inside one. Only a
   block longer than a whole chunk is cut.
5. A table longer than a chunk is cut between its rows (a line break is the strongest
   separator inside it), its first piece beginning with what comes before it in the chunk (its
   heading, say) rather than a chunk of its own. Each piece after the first carries the
   table's header, its first row and the ``| --- |`` line under it (``table_header``), as
   context indexed with it; a piece leaves room for it, so that header and rows together stay
   within ``size`` tokens. A row a search finds so comes with its column names.

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
TABLE_ROW_RE = re.compile(r"^ {0,3}\|.*\|[ \t]*$")
# The line under a Markdown table's header row: "| --- | :-: |".
TABLE_RULE_RE = re.compile(r"^ {0,3}\|(?:[ \t]*:?-+:?[ \t]*\|)+[ \t]*$")


def body_line(line: str) -> str:
    """A line of a document's own text (not a heading the parser found), as the chunker must
    read it: one that would read as a Markdown heading (a root prompt "# apt-get update", a
    comment in an example, a "#" term of a list) is indented four spaces, Markdown's indent for
    code, so that it opens no section and its words name none."""
    return "    " + line if HEADING_RE.match(line) else line


def body_text(text: str) -> str:
    """``text`` with each line outside code fences through ``body_line``."""
    out = []
    in_fence = False
    for line in text.split("\n"):
        if FENCE_RE.match(line):
            in_fence = not in_fence
        out.append(line if in_fence else body_line(line))
    return "\n".join(out)


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


def atomic_blocks(text: str) -> list[tuple[int, int]]:
    """(start, end) of each fenced code block and each table (two or more ``| ... |`` lines)."""
    out: list[tuple[int, int]] = []
    pos = 0
    fence_at: int | None = None
    table_at: int | None = None
    table_rows = 0
    table_end = 0
    for line in text.splitlines(keepends=True):
        stripped = line.rstrip("\r\n")
        if fence_at is not None:
            if FENCE_RE.match(stripped):
                out.append((fence_at, pos + len(stripped)))
                fence_at = None
        elif FENCE_RE.match(stripped):
            fence_at = pos
        if fence_at is None and TABLE_ROW_RE.match(stripped) and not FENCE_RE.match(stripped):
            if table_at is None:
                table_at, table_rows = pos, 0
            table_rows += 1
            table_end = pos + len(stripped)
        elif table_at is not None:
            if table_rows >= 2:
                out.append((table_at, table_end))
            table_at = None
        pos += len(line)
    if fence_at is not None:
        out.append((fence_at, len(text)))
    if table_at is not None and table_rows >= 2:
        out.append((table_at, table_end))
    return sorted(out)


@dataclass(frozen=True)
class Table:
    """A table of the text: ``text[start:end]``; its header (first row, and the ``| --- |``
    line under it if there is one) ends at ``header_end``."""

    start: int
    end: int
    header_end: int

    def header(self, text: str) -> str:
        return text[self.start : self.header_end]


def tables(text: str, blocks: list[tuple[int, int]] | None = None) -> list[Table]:
    """The tables among ``atomic_blocks`` (those that are not code)."""
    out = []
    for start, end in atomic_blocks(text) if blocks is None else blocks:
        first = text.find("\n", start, end)
        if first < 0 or not TABLE_ROW_RE.match(text[start:first]):
            continue  # a code block, or a table of one line (never cut)
        second = text.find("\n", first + 1, end)
        second = end if second < 0 else second
        out.append(Table(start, end, second if TABLE_RULE_RE.match(text[first + 1 : second]) else first))
    return out


def table_at(tabs: list[Table], offset: int, starts: list[int] | None = None) -> Table | None:
    """The table whose rows after its header hold ``offset``: a chunk starting there repeats
    that table's header. ``starts``: the tables' starts, when the caller keeps them."""
    i = bisect.bisect_right([t.start for t in tabs] if starts is None else starts, offset) - 1
    if i >= 0 and tabs[i].header_end < offset < tabs[i].end:
        return tabs[i]
    return None


def table_header(text: str, start: int, tabs: list[Table] | None = None) -> str:
    """The header a chunk of ``text`` that starts at ``start`` carries: that of the table it
    starts in, past the table's header; "" elsewhere."""
    table = table_at(tables(text) if tabs is None else tabs, start)
    return table.header(text) if table is not None else ""


def _inside(blocks: list[tuple[int, int]], offset: int) -> tuple[int, int] | None:
    """The block that ``offset`` falls strictly inside, if any."""
    i = bisect.bisect_right(blocks, (offset, 1 << 62)) - 1
    if i >= 0 and blocks[i][0] < offset < blocks[i][1]:
        return blocks[i]
    return None


def _long_table(block: tuple[int, int], starts: list[int], size: int, table_starts: frozenset[int]) -> bool:
    """Whether ``block`` is a table longer than a chunk: cut between its rows wherever the cut
    falls (its pieces carry its header), rather than moved back to its start, which would
    leave what comes before it (its heading, often) a chunk of its own."""
    if block[0] not in table_starts:
        return False
    return bisect.bisect_left(starts, block[1]) - bisect.bisect_left(starts, block[0]) > size


def _split_tokens(
    text: str,
    toks: list[tuple[int, int]],
    size: int,
    overlap: int,
    blocks: list[tuple[int, int]] | None = None,
    reserve: Callable[[int], int] | None = None,
    table_starts: frozenset[int] = frozenset(),
) -> list[tuple[int, int]]:
    """Token windows [i, j) over ``toks`` following the rules in the module docstring;
    ``reserve(offset)``: the tokens a chunk starting at ``offset`` leaves for a repeated table
    header (at most half the chunk); ``table_starts``: which of the blocks are tables."""
    n = len(toks)
    starts = [t[0] for t in toks]
    blocks = blocks or []
    out: list[tuple[int, int]] = []
    i = 0
    while i < n:
        room = max(size - reserve(starts[i]), max(1, size // 2)) if reserve else size
        j = min(i + room, n)
        before_block = False
        if j < n:
            lo = starts[i + max(1, room // 2)]
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
            block = _inside(blocks, starts[j]) if j < n else None
            if (
                block is not None
                and block[0] > starts[i]
                and not _long_table(block, starts, size, table_starts)
            ):
                # Cut before a code block or table rather than through it.
                j = max(bisect.bisect_left(starts, block[0], i + 1, j), i + 1)
                before_block = True
        out.append((i, j))
        if j >= n:
            break
        # The chunk after a cut before a block starts with the block (overlap would cut it again).
        k = j if before_block else max(j - overlap, i + 1)
        # Start the overlap at a word start.
        while k < j and starts[k] > 0 and not text[starts[k] - 1].isspace():
            k += 1
        block = _inside(blocks, starts[k]) if k < j else None
        if block is not None:
            k = max(min(bisect.bisect_left(starts, block[1], k, j), j), i + 1)
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
    return [
        (start, end, sec.headings)
        for start, end, sec in chunk_spans(text, size=size, overlap=overlap, offsets=offsets)
    ]


def chunk_spans(
    text: str,
    *,
    size: int,
    overlap: int,
    offsets: Offsets = regex_offsets,
) -> list[tuple[int, int, Section]]:
    """(start, end, enclosing section) of each chunk of ``text``."""
    if overlap >= size:
        raise ValueError(f"chunk overlap ({overlap}) must be smaller than the chunk size ({size})")
    all_toks = offsets(text)
    tok_starts = [t[0] for t in all_toks]
    blocks = atomic_blocks(text)
    tabs = tables(text, blocks)
    tab_starts = [t.start for t in tabs]
    # tokens of each table's header, by the table's start
    header_tokens = {
        t.start: bisect.bisect_left(tok_starts, t.header_end) - bisect.bisect_left(tok_starts, t.start)
        for t in tabs
    }

    def reserve(offset: int) -> int:
        table = table_at(tabs, offset, tab_starts)
        return header_tokens[table.start] if table is not None else 0

    out: list[tuple[int, int, Section]] = []
    for sec in sections(text):
        a = bisect.bisect_left(tok_starts, sec.start)
        b = bisect.bisect_left(tok_starts, sec.end)
        toks = [t for t in all_toks[a:b] if t[1] > t[0]]
        if not toks:
            continue
        for i, j in _split_tokens(
            text, toks, size, overlap, blocks, reserve if tabs else None, frozenset(tab_starts)
        ):
            start, end = toks[i][0], min(toks[j - 1][1], sec.end)
            if text[start:end].strip():
                out.append((start, end, sec))
    return out
