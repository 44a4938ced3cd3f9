"""A PDF page as a reader reads it, from its text layer (pypdfium2): each character with its
box, size and type, put together into visual lines; a page set in columns read column by
column; a ruled table as rows of cells, where it stands in the reading order.

* Lines: characters in the order the page draws them join into pieces of a line while each
  follows the last on the same baseline; the pieces that share a baseline are one line, left to
  right. Monospaced lines (code) keep their indentation and inner spacing.
* Columns: a gutter is a vertical strip, wider than a space, that no line crosses over a band of
  ``MIN_COLUMN_ROWS`` rows or more, with text on both sides that the page draws one side after
  the other (as typesetters draw columns) or, drawn row by row or in an order not known (OCR),
  whose lines fill their side the way running text fills a column. The band is read left side
  first, then right side; what is above and below it (a title, a figure across the page, the
  foot) is read in its place. A gap between a term and its description, or between the columns
  of a table that has no rules, is no gutter: those are drawn row by row, and their sides are
  mostly empty.
* Tables: the page's rules (stroked lines and thin filled rectangles, as pypdfium2 reads its
  paths) go through pdfplumber's table finder (``TableFinder``: the cells that the rules close,
  grouped into tables); a table of two rows and two columns or more, half of its cells with
  text at least, becomes a ``TableBlock`` whose characters leave the running text. Rows ruled
  without outer borders (a rule under each row, lines between the columns only) are closed at
  the rules' ends; a title row across the whole table is its caption, not its header; a row
  that holds a list (one entry per baseline in each cell) is a row per baseline.
* Paragraph breaks: a gap between two lines of a column clearly wider than the column's usual
  line pitch (a low quantile of its pitches: double-spaced text has no break at every line).
* A page whose text runs sideways (a landscape page drawn turned) is read in the direction most
  of its characters run.

Boxes are ``(x0, top, x1, bottom)`` in PDF points from the top-left corner of the page as a
viewer shows it: its crop box, turned by its ``/Rotate``.
"""

from __future__ import annotations

import ctypes
import itertools
import re
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from services.retrieval.core.hidden_text import IDENTITY, Matrix, _mul

Box = tuple[float, float, float, float]

# Font names of monospaced (code) type: Courier, *Mono, TeX's typewriter fonts (cmtt10, cmsltt10,
# sftt1000, ectt1000, txtt, lmmono10), ...
MONO_FONT = re.compile(
    r"mono|courier|typewriter|consol|menlo|inconsolata|fixed|(?:^|[+/])(?:cm|cmsl|cmit|sf|sfsl|lm|ec|tc|tx)?tt\d",
    re.I,
)
_FIXED_PITCH = 1  # the FixedPitch bit of a PDF font descriptor's /Flags
# What pdfium puts in place of a hyphen that ends a line (it is still drawn: a '-' here).
_LINE_END_HYPHEN = 2
_SPACES = frozenset((9, 10, 13, 32, 0xA0, 0x2002, 0x2003, 0x2009, 0x3000))
# Rows a column band holds at least; and the share of a band's rows each side must have text in.
MIN_COLUMN_ROWS = 6
_SIDE_ROWS = 0.3
# The median share of its side a line of a column fills: running text, justified or ragged, fills
# nearly all of it; the cells of a table without rules mostly do not.
_COLUMN_FILL = 0.85
# The share of a line's characters in monospaced type that makes it a line of code.
_CODE_SHARE = 0.8
# A gap between two lines of a column this many times its usual pitch, and over half a line
# high, is a paragraph break.
_PARAGRAPH_PITCH = 1.3
# The share of a table's cells that hold text at least (rules that frame other things and
# cross each other close mostly empty cells).
_TABLE_FILL = 0.5
# Path segments of one page read for its rules at most (a plot draws tens of thousands), and
# of one path (a table's rules drawn as one path have a few hundred).
MAX_RULE_SEGMENTS = 20_000
MAX_PATH_SEGMENTS = 2_000
# Rules (joined) of one page that its tables are looked for among, at most.
MAX_RULES = 1_500


@dataclass(frozen=True)
class TextLine:
    """A visual line (or an OCR'd one): its text, box, the size most of its characters are set
    in (points; 0 when not known), whether it is code (set in monospaced type), and whether its
    first and its last word are."""

    text: str
    box: Box
    size: float = 0.0
    mono: bool = False
    mono_start: bool = False
    mono_end: bool = False


@dataclass(frozen=True)
class TableBlock:
    """A ruled table: its rows of cell texts (the first row is the header), each row's box, and
    the title set in a row of its own across its top, if it has one."""

    rows: list[list[str]]
    row_boxes: list[Box]
    box: Box
    caption: TextLine | None = None  # a title row across the whole table, read before it


# A page's reading order: lines, tables, and None where a paragraph ends.
Item = TextLine | TableBlock | None


@dataclass
class PageLayout:
    number: int  # 1-based
    width: float
    height: float
    items: list[Item] = field(default_factory=list)
    chars: int = 0  # characters of its text layer, spaces aside

    @property
    def has_text(self) -> bool:
        return any(isinstance(i, TextLine | TableBlock) for i in self.items)


# --- characters ----------------------------------------------------------------------------------


class _Frame:
    """From PDF user space to the top-left origin of the page a viewer shows."""

    def __init__(self, crop: Sequence[float], rotation: int) -> None:
        self.x0, self.y0, self.x1, self.y1 = (float(v) for v in crop)
        self.rotation = rotation % 360
        w, h = self.x1 - self.x0, self.y1 - self.y0
        self.width, self.height = (h, w) if self.rotation in (90, 270) else (w, h)

    def point(self, x: float, y: float) -> tuple[float, float]:
        if self.rotation == 90:
            return y - self.y0, x - self.x0
        if self.rotation == 180:
            return self.x1 - x, y - self.y0
        if self.rotation == 270:
            return self.y1 - y, self.x1 - x
        return x - self.x0, self.y1 - y

    def box(self, left: float, bottom: float, right: float, top: float) -> Box:
        ax, ay = self.point(left, top)
        bx, by = self.point(right, bottom)
        return (min(ax, bx), min(ay, by), max(ax, bx), max(ay, by))

    def user(self, x: float, y: float) -> tuple[float, float]:
        """The PDF user space point of ``(x, y)`` in this frame."""
        if self.rotation == 90:
            return y + self.x0, x + self.y0
        if self.rotation == 180:
            return self.x1 - x, y + self.y0
        if self.rotation == 270:
            return self.x1 - y, self.y1 - x
        return x + self.x0, self.y1 - y

    def box_in(self, box: Box, other: _Frame) -> Box:
        """``box`` (in this frame) in ``other``."""
        ax, ay = self.user(box[0], box[1])
        bx, by = self.user(box[2], box[3])
        return other.box(min(ax, bx), min(ay, by), max(ax, bx), max(ay, by))


class _Glyph:
    __slots__ = ("bottom", "mono", "size", "space", "text", "top", "x0", "x1")

    def __init__(self, text: str, box: Box, size: float, mono: bool, space: bool) -> None:
        self.text = text
        self.x0, self.top, self.x1, self.bottom = box
        self.size = size
        self.mono = mono
        self.space = space  # a space (the file's or pdfium's) comes before it


def _font_kind(obj: Any, textpage: Any, index: int) -> tuple[bool, int]:
    """(monospaced, direction) of the text object a character belongs to: the direction its
    lines run in, in quarter turns clockwise (0 to 3), or -1 for any other angle."""
    import pypdfium2.raw as pdfium_c

    mono = False
    font = pdfium_c.FPDFTextObj_GetFont(obj) if obj else None
    if font:
        n = pdfium_c.FPDFFont_GetBaseFontName(font, None, 0)
        buf = ctypes.create_string_buffer(max(int(n), 1))
        pdfium_c.FPDFFont_GetBaseFontName(font, buf, len(buf))
        name = buf.value.decode("latin-1", "replace")
        mono = bool(pdfium_c.FPDFFont_GetFlags(font) & _FIXED_PITCH) or bool(MONO_FONT.search(name))
    angle = float(pdfium_c.FPDFText_GetCharAngle(textpage, index))  # radians, clockwise
    degrees = angle * 180 / 3.141592653589793 if angle >= 0 else 0.0
    quarter = round(degrees / 90)
    return mono, quarter % 4 if abs(degrees - 90 * quarter) < 3 else -1


# pypdfium2's FPDFText_GetTextObject gives a typed pointer: this one gives its address (an int).
_TEXT_OBJECT_ADDRESS: Any = None


def _text_object_address() -> Any:
    global _TEXT_OBJECT_ADDRESS
    if _TEXT_OBJECT_ADDRESS is None:
        import pypdfium2.raw as pdfium_c

        proto = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
        _TEXT_OBJECT_ADDRESS = proto(ctypes.cast(pdfium_c.FPDFText_GetTextObject, ctypes.c_void_p).value or 0)
    return _TEXT_OBJECT_ADDRESS


def _glyphs(
    textpage: Any, page_box: Sequence[float], soft_hyphens: Callable[[], set[str]] | None
) -> tuple[list[_Glyph], list[_Glyph], _Frame]:
    """(glyphs, turned glyphs, frame) of a page, in drawing order. ``frame`` is the one its
    text reads in: the page turned so that most of its characters stand upright (as a reader
    turns a page printed sideways); the other glyphs are ``turned``. ``soft_hyphens`` gives the
    words that end a line in a soft hyphen (pdfium shows every line-end hyphen alike)."""
    import pypdfium2.raw as pdfium_c

    raw = textpage.raw
    get_unicode = pdfium_c.FPDFText_GetUnicode
    get_box = pdfium_c.FPDFText_GetLooseCharBox
    get_size = pdfium_c.FPDFText_GetFontSize
    object_at = _text_object_address()
    rect = pdfium_c.FS_RECTF()
    kinds: dict[int, tuple[bool, int]] = {}
    found: list[tuple[str, float, float, float, float, float, bool, int, bool]] = []
    hyphens: list[tuple[int, str]] = []
    word: list[str] = []
    space = False
    for k in range(pdfium_c.FPDFText_CountChars(raw)):
        u = get_unicode(raw, k)
        if u in _SPACES:
            space = True
            word.clear()
            continue
        if (u < 32 and u != _LINE_END_HYPHEN) or 0xD800 <= u <= 0xDFFF or u in (0xFFFE, 0xFFFF):
            continue
        get_box(raw, k, rect)
        key = object_at(raw, k) or 0
        kind = kinds.get(key)
        if kind is None:
            obj = ctypes.cast(key, pdfium_c.FPDF_PAGEOBJECT) if key else None
            kind = kinds[key] = _font_kind(obj, raw, k)
        text = "-" if u == _LINE_END_HYPHEN else chr(u)
        if u == _LINE_END_HYPHEN:
            hyphens.append((len(found), "".join(word)))
        found.append(
            (text, rect.left, rect.bottom, rect.right, rect.top, get_size(raw, k), kind[0], kind[1], space)
        )
        space = False
        word.append(text)
    ways = Counter(f[7] for f in found if f[7] >= 0)
    way = ways.most_common(1)[0][0] if ways else 0
    frame = _Frame(page_box, -90 * way)
    plain = frame.rotation == 0
    fx0, fy1 = frame.x0, frame.y1
    upright: list[_Glyph] = []
    turned: list[_Glyph] = []
    glyphs: list[_Glyph] = []
    for text, left, bottom, right, top, size, mono, direction, spaced in found:
        if plain:
            box = (left - fx0, fy1 - top, right - fx0, fy1 - bottom)
        else:
            box = frame.box(left, bottom, right, top)
        g = _Glyph(text, box, size, mono, spaced)
        glyphs.append(g)
        (upright if direction == way else turned).append(g)
    if hyphens and soft_hyphens is not None:
        soft = soft_hyphens()
        for n, before in hyphens:
            m = re.search(r"\w+$", before)
            if m and m.group(0) in soft:
                glyphs[n].text = "\u00ad"
    return upright, turned, frame


# --- pieces of lines and lines ---------------------------------------------------------------------


class _Piece:
    """Characters drawn one after the other on one baseline: part of a line."""

    __slots__ = ("bottom", "glyphs", "order", "top", "x0", "x1")

    def __init__(self, glyphs: list[_Glyph], order: int = 0) -> None:
        self.glyphs = glyphs
        self.order = order  # where the page draws it among its pieces
        self.x0 = min(g.x0 for g in glyphs)
        self.x1 = max(g.x1 for g in glyphs)
        self.top = min(g.top for g in glyphs)
        self.bottom = max(g.bottom for g in glyphs)

    @property
    def mono(self) -> bool:
        return _monospaced(self.glyphs)

    @property
    def advance(self) -> float:
        """The width of one character (of monospaced type)."""
        return max(statistics.median(g.x1 - g.x0 for g in self.glyphs), 0.1)

    def text(self) -> str:
        out = [self.glyphs[0].text]
        mono = self.mono
        step = self.advance
        for p, g in zip(self.glyphs, self.glyphs[1:], strict=False):
            if mono:
                n = round((g.x0 - p.x1) / step)
                out.append(" " * max(n, 1 if g.space else 0))
            elif g.space:
                out.append(" ")
            out.append(g.text)
        return "".join(out)


def _monospaced(glyphs: Sequence[_Glyph]) -> bool:
    """Whether text is code: its characters are (nearly) all of monospaced type."""
    return sum(g.mono for g in glyphs) >= _CODE_SHARE * len(glyphs)


def _em(a: _Glyph, b: _Glyph) -> float:
    size = max(a.size, b.size)
    return size if size > 0 else max(a.bottom - a.top, b.bottom - b.top, 1.0) / 1.2


def _follows(p: _Glyph, g: _Glyph) -> bool:
    """Whether ``g``, drawn after ``p``, goes on the same piece of a line."""
    h = max(p.bottom - p.top, g.bottom - g.top, 0.5)
    if abs((g.top + g.bottom) - (p.top + p.bottom)) / 2 > 0.45 * h:
        return False  # another baseline
    if g.x0 < p.x0 - 0.05 * h:
        return False  # drawn back to the left: another line, or text over text
    return g.x0 - p.x1 <= 0.8 * _em(p, g)


def _pieces(glyphs: list[_Glyph]) -> list[_Piece]:
    out: list[_Piece] = []
    run: list[_Glyph] = []
    for g in glyphs:
        if run and not _follows(run[-1], g):
            out.append(_Piece(run, len(out)))
            run = []
        run.append(g)
    if run:
        out.append(_Piece(run, len(out)))
    return out


class _Row:
    """Things on one baseline (pieces of lines, or a table's block), left to right."""

    __slots__ = ("anchor", "bottom", "items", "top", "x0", "x1")

    def __init__(self, item: Any) -> None:
        self.items = [item]
        self.anchor = (item.top, item.bottom)
        self.top, self.bottom, self.x0, self.x1 = item.top, item.bottom, item.x0, item.x1

    def add(self, item: Any) -> None:
        self.items.append(item)
        self.top, self.bottom = min(self.top, item.top), max(self.bottom, item.bottom)
        self.x0, self.x1 = min(self.x0, item.x0), max(self.x1, item.x1)


def rows_of(items: Iterable[Any]) -> list[_Row]:
    """``items`` grouped by baseline, top to bottom: an item joins a recent row when it shares
    half its height with the row's first item."""
    rows: list[_Row] = []
    for it in sorted(items, key=lambda i: (i.top, i.x0)):
        h = max(it.bottom - it.top, 0.5)
        for row in reversed(rows[-3:]):
            top, bottom = row.anchor
            shared = min(bottom, it.bottom) - max(top, it.top)
            if shared >= 0.5 * min(h, max(bottom - top, 0.5)) and not isinstance(it, _Table):
                row.add(it)
                break
        else:
            rows.append(_Row(it))
    for row in rows:
        row.items.sort(key=lambda i: i.x0)
    return rows


# --- columns -------------------------------------------------------------------------------------


def _free(row: _Row, lo: float, hi: float, min_gap: float) -> list[tuple[float, float]]:
    """The strips of ``[lo, hi]`` no item of ``row`` covers, ``min_gap`` wide at least."""
    out: list[tuple[float, float]] = []
    at = lo
    for it in row.items:
        if it.x0 - at >= min_gap:
            out.append((at, it.x0))
        at = max(at, it.x1)
    if hi - at >= min_gap:
        out.append((at, hi))
    return out


def _gutter(rows: list[_Row], size: float) -> tuple[int, int, float, float] | None:
    """(first row, last row, x0, x1) of the gutter between two columns of ``rows``, or None."""
    if len(rows) < MIN_COLUMN_ROWS:
        return None
    lo, hi = min(r.x0 for r in rows), max(r.x1 for r in rows)
    width = hi - lo
    min_gap = max(6.0, 0.8 * size)
    runs: list[tuple[float, float, int, int]] = []  # (x0, x1, first row, last row)
    open_: list[tuple[float, float, int]] = []
    for n, row in enumerate(rows):
        free = _free(row, lo, hi, min_gap)
        going: list[tuple[float, float, int]] = []
        for a, b, first in open_:
            kept = False
            for fa, fb in free:
                x0, x1 = max(a, fa), min(b, fb)
                if x1 - x0 >= min_gap:
                    going.append((x0, x1, first))
                    kept = True
            if not kept:
                runs.append((a, b, first, n - 1))
        for fa, fb in free:
            if not any(x1 > fa and x0 < fb for x0, x1, _ in going):
                going.append((fa, fb, n))
        # one strip per start: the widest
        best: dict[tuple[int, int], tuple[float, float, int]] = {}
        for x0, x1, first in going:
            k = (round(x0), first)
            if k not in best or x1 - x0 > best[k][1] - best[k][0]:
                best[k] = (x0, x1, first)
        open_ = list(best.values())[:32]
    runs += [(a, b, first, len(rows) - 1) for a, b, first in open_]
    found: tuple[int, tuple[int, int, float, float]] | None = None
    for a, b, first, last in runs:
        n = last - first + 1
        if n < MIN_COLUMN_ROWS or a < lo + 0.1 * width or b > hi - 0.1 * width:
            continue
        if found is not None and n <= found[0]:
            continue
        if _columns_fill(rows[first : last + 1], lo, a, b, hi):
            found = (n, (first, last, a, b))
    return found[1] if found else None


def _columns_fill(rows: list[_Row], lo: float, a: float, b: float, hi: float) -> bool:
    """Whether the rows left of ``a`` and right of ``b`` read as two columns of text: each side
    has text in enough rows, and the page draws one side and then the other (as typesetters
    draw columns), or, where it draws them row by row or its order is not known (OCR), the lines
    of each side fill most of it. A table or a list of terms beside their descriptions is drawn
    row by row, and its cells mostly do not fill their side."""
    left, right = [], []
    for row in rows:
        ls = [i for i in row.items if i.x1 <= a + 0.5]
        rs = [i for i in row.items if i.x0 >= b - 0.5]
        if ls and not any(isinstance(i, _Table) for i in ls):
            left.append(max(i.x1 for i in ls) - min(i.x0 for i in ls))
        if rs and not any(isinstance(i, _Table) for i in rs):
            right.append(max(i.x1 for i in rs) - min(i.x0 for i in rs))
    need = max(3, _SIDE_ROWS * len(rows))
    if len(left) < need or len(right) < need:
        return False
    drawn = sorted(
        (
            i
            for row in rows
            for i in row.items
            if isinstance(i, _Piece) and (i.x1 <= a + 0.5 or i.x0 >= b - 0.5)
        ),
        key=lambda i: i.order,
    )
    if len(drawn) >= 2 * MIN_COLUMN_ROWS:
        turns = sum((p.x1 <= a + 0.5) != (q.x1 <= a + 0.5) for p, q in itertools.pairwise(drawn))
        if turns <= max(2, len(rows) // 10):
            return True  # drawn a column at a time
        if turns >= len(rows) // 2:
            return False  # drawn a row at a time
    return statistics.median(left) >= _COLUMN_FILL * (a - lo) and statistics.median(right) >= _COLUMN_FILL * (
        hi - b
    )


def _trimmed(rows: list[_Row], first: int, last: int, a: float, b: float) -> tuple[int, int, float, float]:
    """A column band grown by the rows above and below it that leave the middle of its gutter
    clear (a line that runs a little into the gutter still belongs to its column), then without
    the rows at its top and foot that stand apart from it (a running head with its page number
    at the right, a foot): those are read before and after it."""
    mid = (a + b) / 2

    def clear(row: _Row) -> bool:
        return not any(i.x0 < mid + 1 and i.x1 > mid - 1 for i in row.items)

    while first > 0 and clear(rows[first - 1]):
        first -= 1
    while last + 1 < len(rows) and clear(rows[last + 1]):
        last += 1
    pitches = [rows[n + 1].top - rows[n].top for n in range(first, last)]
    usual = statistics.median(pitches) if pitches else 0.0
    while last - first >= MIN_COLUMN_ROWS and rows[first + 1].top - rows[first].top > 2 * usual + 1:
        first += 1
    while last - first >= MIN_COLUMN_ROWS and rows[last].top - rows[last - 1].top > 2 * usual + 1:
        last -= 1
    return first, last, a, b


def reading_groups(items: list[Any], size: float, depth: int = 0) -> list[list[Any]]:
    """``items`` in groups read one after the other: the columns of each band in turn."""
    if not items:
        return []
    rows = rows_of(items)
    gutter = _gutter(rows, size) if depth < 6 else None
    if gutter is None:
        return [items]
    first, last, a, b = _trimmed(rows, *gutter)
    above = [i for r in rows[:first] for i in r.items]
    band = [i for r in rows[first : last + 1] for i in r.items]
    below = [i for r in rows[last + 1 :] for i in r.items]
    mid = (a + b) / 2
    left = [i for i in band if (i.x0 + i.x1) / 2 < mid]
    right = [i for i in band if (i.x0 + i.x1) / 2 >= mid]
    return [
        *reading_groups(above, size, depth + 1),
        *reading_groups(left, size, depth + 1),
        *reading_groups(right, size, depth + 1),
        *reading_groups(below, size, depth + 1),
    ]


@dataclass
class _Table:
    """A table's block among the pieces of lines, while the page is put in order."""

    block: TableBlock

    @property
    def x0(self) -> float:
        return self.block.box[0]

    @property
    def top(self) -> float:
        return self.block.box[1]

    @property
    def x1(self) -> float:
        return self.block.box[2]

    @property
    def bottom(self) -> float:
        return self.block.box[3]


def _line(row: _Row, left: float) -> TextLine:
    """One row of pieces as a line; monospaced text keeps its indentation from ``left`` (the
    column's left edge) and the spaces between its pieces."""
    pieces: list[_Piece] = []
    for p in row.items:
        if any(
            q.glyphs[0].text == p.glyphs[0].text
            and abs(q.x0 - p.x0) < 1.5
            and abs(q.top - p.top) < 1.5
            and q.text() == p.text()
            for q in pieces
        ):
            continue  # drawn twice over itself (a fake bold)
        pieces.append(p)
    glyphs = [g for p in pieces for g in p.glyphs]
    mono = _monospaced(glyphs)
    out: list[str] = []
    step = pieces[0].advance
    if mono and (n := round((pieces[0].x0 - left) / step)) > 0:
        out.append(" " * n)
    for i, p in enumerate(pieces):
        if i:
            gap = p.x0 - pieces[i - 1].x1
            out.append(" " * max(1, round(gap / step)) if mono else " ")
        out.append(p.text())
    sizes: Counter[float] = Counter()
    for g in glyphs:
        sizes[round(g.size, 1)] += 1
    box = (row.x0, min(p.top for p in pieces), row.x1, max(p.bottom for p in pieces))
    return TextLine(
        "".join(out).rstrip(), box, sizes.most_common(1)[0][0], mono, glyphs[0].mono, glyphs[-1].mono
    )


def _group_items(group: list[Any]) -> list[Item]:
    """A column's (or a band's) pieces and tables as lines and tables, top to bottom, with a
    paragraph break where the gap between two lines is wider than the usual pitch."""
    pieces = [i for i in group if isinstance(i, _Piece)]
    tables = [i for i in group if isinstance(i, _Table)]
    left = min((p.x0 for p in pieces), default=0.0)
    lines = [_line(r, left) for r in rows_of(pieces)]
    pitches = [b.box[1] - a.box[1] for a, b in itertools.pairwise(lines) if b.box[1] > a.box[1]]
    # the pitch of lines within a paragraph: a low quantile, as paragraphs may be short
    usual = sorted(pitches)[len(pitches) // 4] if len(pitches) >= 3 else None
    placed: list[tuple[float, int, Item]] = []
    for n, line in enumerate(lines):
        if n and usual is not None:
            prev = lines[n - 1]
            pitch = line.box[1] - prev.box[1]
            height = max(line.box[3] - line.box[1], prev.box[3] - prev.box[1])
            if pitch > _PARAGRAPH_PITCH * usual + 1 and line.box[1] - prev.box[3] > 0.6 * height:
                placed.append((line.box[1], 0, None))
        placed.append((line.box[1], 1, line))
    for t in tables:
        placed.append((t.top, 1, t.block))
    placed.sort(key=lambda p: (p[0], p[1]))
    return [item for _, _, item in placed]


def _turned_lines(glyphs: list[_Glyph]) -> list[TextLine]:
    """Text set at an angle (a margin note, a stamp), one line per run of it, as drawn."""
    out: list[TextLine] = []
    run: list[_Glyph] = []

    def flush() -> None:
        if run:
            text = "".join((" " if g.space and i else "") + g.text for i, g in enumerate(run))
            box = (
                min(g.x0 for g in run),
                min(g.top for g in run),
                max(g.x1 for g in run),
                max(g.bottom for g in run),
            )
            out.append(TextLine(text, box, 0.0, False))
            run.clear()

    for g in glyphs:
        if (
            run
            and g.space
            and len(run) > 1
            and abs(g.x0 - run[-1].x0) + abs(g.top - run[-1].top) > 4 * _em(g, run[-1])
        ):
            flush()
        run.append(g)
    flush()
    return out


# --- tables --------------------------------------------------------------------------------------


class _RulesPage:
    """What pdfplumber's ``TableFinder`` reads of a page: its edges and its box."""

    def __init__(self, edges: list[dict[str, Any]], width: float, height: float) -> None:
        self.edges = edges
        self.bbox = (0.0, 0.0, width, height)


def _edge(x0: float, top: float, x1: float, bottom: float) -> dict[str, Any]:
    horizontal = bottom - top < x1 - x0
    if horizontal:
        top = bottom = (top + bottom) / 2
    else:
        x0 = x1 = (x0 + x1) / 2
    return {
        "x0": x0,
        "x1": x1,
        "top": top,
        "bottom": bottom,
        "doctop": top,
        "width": x1 - x0,
        "height": bottom - top,
        "orientation": "h" if horizontal else "v",
        "object_type": "line",
    }


def _rules(page: Any, frame: _Frame) -> list[dict[str, Any]]:
    """The straight horizontal and vertical strokes and thin fills of a page's paths (forms
    included), as edges in page units."""
    import pypdfium2.raw as pdfium_c

    edges: list[dict[str, Any]] = []
    budget = [MAX_RULE_SEGMENTS]
    matrix = pdfium_c.FS_MATRIX()
    fill, stroke = ctypes.c_int(), ctypes.c_int()
    fx, fy = ctypes.c_float(), ctypes.c_float()

    def path(obj: Any, m: Matrix) -> None:
        if not pdfium_c.FPDFPath_GetDrawMode(obj, fill, stroke) or (not fill.value and not stroke.value):
            return
        count = pdfium_c.FPDFPath_CountSegments(obj)
        if count <= 0 or count > MAX_PATH_SEGMENTS:
            return  # a curve of a plot, a drawing: no rules of a table
        budget[0] -= count
        start = cur = None
        segments: list[tuple[tuple[float, float], tuple[float, float]]] = []
        for i in range(count):
            seg = pdfium_c.FPDFPath_GetPathSegment(obj, i)
            pdfium_c.FPDFPathSegment_GetPoint(seg, fx, fy)
            x, y = fx.value, fy.value
            pt = (x * m[0] + y * m[2] + m[4], x * m[1] + y * m[3] + m[5])
            kind = pdfium_c.FPDFPathSegment_GetType(seg)
            if kind == pdfium_c.FPDF_SEGMENT_MOVETO:
                start = cur = pt
            elif kind == pdfium_c.FPDF_SEGMENT_LINETO and cur is not None:
                segments.append((cur, pt))
                cur = pt
            else:
                cur = pt
            if pdfium_c.FPDFPathSegment_GetClose(seg) and start is not None and cur is not None:
                segments.append((cur, start))
                cur = start
        for (ax, ay), (bx, by) in segments:
            x0, top, x1, bottom = frame.box(min(ax, bx), min(ay, by), max(ax, bx), max(ay, by))
            if bottom - top <= 1.0 or x1 - x0 <= 1.0:
                edges.append(_edge(x0, top, x1, bottom))

    def walk(objects: Iterable[Any], m: Matrix, depth: int) -> None:
        for obj in objects:
            if budget[0] <= 0:
                return
            kind = pdfium_c.FPDFPageObj_GetType(obj)
            if kind not in (pdfium_c.FPDF_PAGEOBJ_PATH, pdfium_c.FPDF_PAGEOBJ_FORM):
                continue
            if not pdfium_c.FPDFPageObj_GetMatrix(obj, matrix):
                continue
            own = _mul((matrix.a, matrix.b, matrix.c, matrix.d, matrix.e, matrix.f), m)
            if kind == pdfium_c.FPDF_PAGEOBJ_PATH:
                path(obj, own)
            elif depth < 4:
                n = pdfium_c.FPDFFormObj_CountObjects(obj)
                walk((pdfium_c.FPDFFormObj_GetObject(obj, i) for i in range(max(n, 0))), own, depth + 1)

    n = pdfium_c.FPDFPage_CountObjects(page)
    walk((pdfium_c.FPDFPage_GetObject(page, i) for i in range(max(n, 0))), IDENTITY, 0)
    return edges


def _outer_borders(edges: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Vertical edges at both ends of rules (each joined from its pieces) that span the same
    width, between two of them that have a vertical line between them: the sides of a table
    ruled between its rows and its columns but not along its sides."""
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in edges:
        if e["orientation"] == "h" and e["width"] >= 20:
            groups.setdefault((round(e["x0"] / 2), round(e["x1"] / 2)), []).append(e)
    verticals = [e for e in edges if e["orientation"] == "v"]
    out = []
    for rules in groups.values():
        rules.sort(key=lambda e: e["top"])
        x0, x1 = rules[0]["x0"], rules[0]["x1"]
        for upper, lower in itertools.pairwise(rules):
            top, bottom = upper["top"], lower["top"]
            if any(
                x0 + 2 < v["x0"] < x1 - 2 and v["top"] <= top + 3 and v["bottom"] >= bottom - 3
                for v in verticals
            ):
                out += [_edge(x, top, x, bottom) for x in (x0, x1)]
    return out


def _cell_lines(glyphs: list[_Glyph]) -> list[_Row]:
    return rows_of(_pieces(glyphs)) if glyphs else []


def _cell_text(lines: list[_Row]) -> str:
    """A cell's lines as one line of text, its hyphenated words joined."""
    if not lines:
        return ""
    from services.retrieval.core.text_cleanup import join_hyphenated

    left = min(r.x0 for r in lines)
    text = "\n".join(_line(r, left).text.strip() for r in lines)
    return " ".join(join_hyphenated([text])[0].split())


def _row_lines(cells: list[list[_Row]], box: Box) -> list[tuple[list[str], Box]]:
    """A table row's cells as text. A row that holds a list, each line of it on one baseline
    across the cells (the body of a table ruled only around it), is a row per baseline: three
    baselines at least, two cells with a line on most of them."""
    bands: list[list[tuple[int, _Row]]] = []
    for c, lines in enumerate(cells):
        for line in lines:
            mid, h = (line.top + line.bottom) / 2, max(line.bottom - line.top, 0.5)
            for band in bands:
                first = band[0][1]
                if abs((first.top + first.bottom) / 2 - mid) <= 0.5 * max(h, first.bottom - first.top):
                    band.append((c, line))
                    break
            else:
                bands.append([(c, line)])
    listed = sum(
        len({b for b, band in enumerate(bands) for cc, _ in band if cc == c}) >= 0.75 * len(bands)
        for c in range(len(cells))
    )
    if len(bands) < 3 or listed < 2 or any(len({c for c, _ in band}) < len(band) for band in bands):
        return [([_cell_text(lines) for lines in cells], box)]
    out = []
    for band in sorted(bands, key=lambda b: min(r.top for _, r in b)):
        texts = [_cell_text([r for cc, r in band if cc == c]) for c in range(len(cells))]
        out.append((texts, (box[0], min(r.top for _, r in band), box[2], max(r.bottom for _, r in band))))
    return out


def _cell_at(rows: Sequence[Any], x: float, y: float) -> tuple[int, int] | None:
    for r, row in enumerate(rows):
        if row.bbox[1] <= y <= row.bbox[3]:
            for c, cell in enumerate(row.cells):
                if cell is not None and cell[0] <= x <= cell[2] and cell[1] <= y <= cell[3]:
                    return r, c
    return None


def _tables(page: Any, frame: _Frame, glyphs: list[_Glyph]) -> tuple[list[TableBlock], list[_Glyph]]:
    """The ruled tables of a page, and the glyphs that are not in them."""
    edges = _rules(page, frame)
    if len([e for e in edges if e["orientation"] == "h"]) < 3:
        return [], glyphs
    from pdfplumber.table import TableFinder, merge_edges

    edges = merge_edges(edges, 3, 3, 3, 3)  # pdfplumber's default tolerances
    if len(edges) > MAX_RULES:
        return [], glyphs  # a drawing, not tables: the finder's work grows with the square
    edges += _outer_borders(edges)
    found = TableFinder(_RulesPage(edges, frame.width, frame.height)).tables  # type: ignore[arg-type]
    taken: set[int] = set()
    blocks: list[TableBlock] = []
    for table in found:
        rows = table.rows
        width = max((len(r.cells) for r in rows), default=0)
        if len(rows) < 2 or width < 2:
            continue
        x0, top, x1, bottom = table.bbox
        cells: list[list[list[_Glyph]]] = [[[] for _ in r.cells] for r in rows]
        used: set[int] = set()
        at: tuple[int, int] | None = None  # the cell of the word being read
        prev: _Glyph | None = None
        for i, g in enumerate(glyphs):
            cx, cy = (g.x0 + g.x1) / 2, (g.top + g.bottom) / 2
            if i in taken or not (x0 <= cx <= x1 and top <= cy <= bottom):
                prev = None
                continue
            # a word that runs over its cell's border stays in the cell it starts in
            if (
                at is None
                or prev is None
                or g.space
                or not _follows(prev, g)
                or g.x0 - prev.x1 > 0.3 * _em(prev, g)
            ):
                at = _cell_at(rows, cx, cy)
            prev = g
            if at is not None:
                cells[at[0]][at[1]].append(g)
                used.add(i)
        caption: TextLine | None = None
        first = [c for c in cells[0] if c]
        if (
            len(first) == 1
            and rows[0].cells[0] is not None
            and rows[0].cells[0][2] - rows[0].cells[0][0] >= 0.9 * (x1 - x0)
        ):
            # a title across the whole table: a line above it, not its header
            lines = _cell_lines(first[0])
            caption = TextLine(_cell_text(lines), tuple(rows[0].bbox), _line(lines[0], lines[0].x0).size)  # type: ignore[arg-type]
            rows, cells = rows[1:], cells[1:]
        texts: list[list[str]] = []
        boxes: list[Box] = []
        for row, row_cells in zip(rows, cells, strict=True):
            for row_texts, box in _row_lines([_cell_lines(c) for c in row_cells], tuple(row.bbox)):  # type: ignore[arg-type]
                texts.append(row_texts)
                boxes.append(box)
        filled = sum(bool(t) for r in texts for t in r)
        filled_columns = sum(any(c < len(r) and r[c] for r in texts) for c in range(width))
        if len(texts) < 2 or filled_columns < 2 or filled < max(3, _TABLE_FILL * len(texts) * width):
            continue  # rules that frame something else (boxes, shaded code) and cross
        taken |= used
        blocks.append(TableBlock(texts, boxes, tuple(table.bbox), caption))  # type: ignore[arg-type]
    return blocks, [g for i, g in enumerate(glyphs) if i not in taken]


# --- pages ---------------------------------------------------------------------------------------


def page_layout(page: Any, number: int, *, soft_hyphens: Callable[[], set[str]] | None = None) -> PageLayout:
    """The reading order of one pypdfium2 page (``PdfPage``): its lines and tables, their boxes
    on the page as a viewer shows it."""
    page_box = page.get_bbox()  # the crop box within the media box
    shown = _Frame(page_box, page.get_rotation())
    out = PageLayout(number, round(shown.width, 2), round(shown.height, 2))
    textpage = page.get_textpage()
    try:
        glyphs, turned, frame = _glyphs(textpage, page_box, soft_hyphens)
    finally:
        textpage.close()
    out.chars = len(glyphs) + len(turned)
    if not glyphs and not turned:
        return out
    tables, glyphs = _tables(page, frame, glyphs) if glyphs else ([], glyphs)
    sizes = Counter(round(g.size, 1) for g in glyphs)
    size = sizes.most_common(1)[0][0] if sizes else 10.0
    items: list[Any] = [*_pieces(glyphs), *(_Table(t) for t in tables)]
    groups = reading_groups(items, size)
    for n, group in enumerate(groups):
        lines = _group_items(group)
        if n and out.items and lines:
            prev = next((i for i in reversed(out.items) if isinstance(i, TextLine | TableBlock)), None)
            first = next((i for i in lines if isinstance(i, TextLine | TableBlock)), None)
            if prev is not None and first is not None and first.box[1] - prev.box[3] > size:
                out.items.append(None)  # a band below the last, after a gap: a new paragraph
        out.items += lines
    out.items += _turned_lines(turned)
    if frame.rotation != shown.rotation:
        out.items = [_shown(item, frame, shown) for item in out.items]
    return out


def _shown(item: Item, frame: _Frame, shown: _Frame) -> Item:
    """``item`` with its boxes moved from the frame the page was read in to the page as shown."""
    if isinstance(item, TextLine):
        return replace(item, box=frame.box_in(item.box, shown))
    if isinstance(item, TableBlock):
        caption = _shown(item.caption, frame, shown) if item.caption is not None else None
        rows = [frame.box_in(b, shown) for b in item.row_boxes]
        return replace(item, row_boxes=rows, box=frame.box_in(item.box, shown), caption=caption)  # type: ignore[arg-type]
    return item


def ocr_layout(number: int, width: float, height: float, lines: Sequence[tuple[str, Box]]) -> PageLayout:
    """A page read by OCR: its lines (text and box) in the reading order OCR gave them."""
    items: list[Item] = [TextLine(text.strip(), box) for text, box in lines if text.strip()]
    return PageLayout(number, round(width, 2), round(height, 2), items, sum(len(t) for t, _ in lines))
