"""Where things are in a document's text: its PDF pages, the boxes of its lines on them and its
HTML anchors, and what each chunk learns from them.

A parser returns, besides the text, a ``structure`` dict (``InputDocument.structure``):

* ``pages``: ``[[page, start], ...]``, 1-based PDF page numbers and the offset in the text at
  which each page begins (in page order; an empty page begins where the next one does);
* ``anchors``: ``[[start, id], ...]``, HTML ``id``s of headings and the offset of the heading
  line they name;
* ``lines``: ``[[start, end, page, x0, top, x1, bottom], ...]``, the offsets in the text of each
  visual line of a PDF page (or table row, or line read by OCR), in text order, its 1-based page
  and its box in page units from the page's top-left corner (PDF points; pixels for images);
* ``page_sizes``: ``[[page, width, height], ...]`` in the same units.

Headings themselves are ``#`` lines of the text (see ``parsing.py``), so the heading path of a
chunk comes from the chunker. ``chunk_structure`` is what a chunk stores of all this.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable
from typing import Any

from services.common.chunking import Section

# Marks an anchor inside text being built (a parser's scratch): "\x00A<n>\x00" names anchor n.
_SENTINEL_RE = re.compile(r"\x00A(\d+)\x00")


def sentinel(n: int) -> str:
    return f"\x00A{n}\x00"


def take_sentinels(text: str, ids: list[str]) -> tuple[str, list[list[Any]]]:
    """``text`` without its anchor sentinels, and ``[[offset, id], ...]`` where they stood."""
    out: list[str] = []
    anchors: list[list[Any]] = []
    pos = size = 0
    for m in _SENTINEL_RE.finditer(text):
        piece = text[pos : m.start()]
        out.append(piece)
        size += len(piece)
        n = int(m.group(1))
        if n < len(ids) and (not anchors or anchors[-1][1] != ids[n]):
            anchors.append([size, ids[n]])
        pos = m.end()
    out.append(text[pos:])
    return "".join(out), anchors


def pages_of(pages: list[list[int]], start: int, end: int) -> tuple[list[int], list[int]]:
    """(page numbers, their start offsets clipped to ``start``) of the text ``[start, end)``."""
    if not pages:
        return [], []
    starts = [int(p[1]) for p in pages]
    first = max(bisect.bisect_right(starts, start) - 1, 0)
    nums: list[int] = []
    offs: list[int] = []
    for i in range(first, len(pages)):
        page_start = starts[i]
        page_end = starts[i + 1] if i + 1 < len(pages) else None
        if page_start >= end and nums:
            break
        if page_end is not None and page_end <= start:
            continue
        if page_end is not None and page_end == page_start:
            continue  # an empty page
        nums.append(int(pages[i][0]))
        offs.append(max(page_start, start))
    return nums, offs


def page_at(pages: list[int], page_starts: list[int], offset: int) -> int | None:
    """The page of the character at ``offset`` among a chunk's ``pages``."""
    if not pages:
        return None
    i = bisect.bisect_right(page_starts, offset) - 1
    return pages[max(i, 0)]


def anchor_at(anchors: list[list[Any]], offset: int, not_before: int = 0) -> str | None:
    """The id of the last anchor at or before ``offset`` (and not before ``not_before``: the
    start of the chunk's section, so a section without an anchor gets none)."""
    if not anchors:
        return None
    i = bisect.bisect_right([int(a[0]) for a in anchors], offset) - 1
    return str(anchors[i][1]) if i >= 0 and int(anchors[i][0]) >= not_before else None


def boxes_of(lines: list[list[Any]], start: int, end: int) -> list[list[Any]]:
    """The ``lines`` that overlap the text ``[start, end)``, their offsets made relative to
    ``start`` and clipped to the span: ``[[start, end, page, x0, top, x1, bottom], ...]``."""
    if not lines or end <= start:
        return []
    first = bisect.bisect_right(lines, start, key=lambda ln: ln[1])  # the first ending after start
    last = bisect.bisect_left(lines, end, key=lambda ln: ln[0])  # past the last starting before end
    return [
        [max(int(ln[0]), start) - start, min(int(ln[1]), end) - start, *ln[2:7]]
        for ln in lines[first:last]
        if int(ln[1]) > start and int(ln[0]) < end
    ]


def chunk_structure(structure: dict[str, Any], start: int, end: int, section: Section) -> dict[str, Any]:
    """What a chunk stores of its document's structure: ``section`` (the
    heading path), ``headings``, ``section_start``/``section_end`` (the enclosing section),
    ``pages`` and ``page_starts`` (PDF), ``anchor`` (HTML), ``boxes`` (the lines of its text on
    their pages, offsets counted from the chunk's start: ``boxes_of``) and ``page_sizes`` (of
    the pages those are on)."""
    out: dict[str, Any] = {}
    if section.headings:
        out["section"] = " > ".join(section.headings)
        out["headings"] = list(section.headings)
    out["section_start"], out["section_end"] = section.start, section.end
    pages, starts = pages_of(structure.get("pages") or [], start, end)
    if pages:
        out["pages"] = pages
        out["page_starts"] = starts
    anchor = anchor_at(structure.get("anchors") or [], start, section.start)
    if anchor:
        out["anchor"] = anchor
    boxes = boxes_of(structure.get("lines") or [], start, end)
    if boxes:
        on = {b[2] for b in boxes}
        out["boxes"] = boxes
        out["page_sizes"] = [list(s) for s in structure.get("page_sizes") or [] if s[0] in on]
    return out


def section_window(
    text: str,
    lo: int,
    hi: int,
    start: int,
    end: int,
    tokens: int,
    offsets: Callable[[str], list[tuple[int, int]]],
) -> tuple[int, int]:
    """(start, end) of at most ``tokens`` tokens of the section ``text[lo:hi]`` around the chunk
    ``[start, end)``: the chunk, then as much of the section before and after it as fits, evenly."""
    toks = [(a + lo, b + lo) for a, b in offsets(text[lo:hi]) if b > a]
    if not toks or tokens <= 0:
        return start, end
    starts = [a for a, _ in toks]
    first = bisect.bisect_left(starts, start)
    last = max(bisect.bisect_left(starts, end), first)  # tokens [first, last) are the chunk's
    spare = tokens - (last - first)
    if spare <= 0:
        return start, end
    before = min(first, spare // 2)
    after = min(len(toks) - last, spare - before)
    before = min(first, spare - after)
    a, b = first - before, last + after
    return min(toks[a][0], start) if a < len(toks) else start, max(toks[b - 1][1], end) if b > 0 else end
