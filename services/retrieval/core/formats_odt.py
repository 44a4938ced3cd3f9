"""OpenDocument text files (.odt, read with odfpy) as documents, in the order of their body:
headings (``text:h``, by outline level) as ``#`` lines, paragraphs, lists as ``- `` items
(nested ones indented), and tables as Markdown tables (core/tables.py) whose first row is the
header. Sections and frames are read where they stand; tracked deletions, the table of
contents and comments are not the text a reader reads, and are left out. Footnotes stand in
brackets where they are cited.

Repeated cells and rows (``number-columns-repeated``: a file may claim a million) count against
``TANDEM_RETRIEVAL_PARSE_MAX_CELLS``, and runs of spaces (``text:s``) are capped, so a small
file cannot make a huge text.
"""

from __future__ import annotations

import io
from typing import Any

from services.common.chunking import body_text
from services.retrieval.core.format_errors import reading
from services.retrieval.core.parsing import ParseLimits, _tidy, check_zip
from services.retrieval.core.tables import CellBudget, markdown_table, used_range
from services.retrieval.core.text_cleanup import fix_characters

TEXT = "urn:oasis:names:tc:opendocument:xmlns:text:1.0"
TABLE = "urn:oasis:names:tc:opendocument:xmlns:table:1.0"
OFFICE = "urn:oasis:names:tc:opendocument:xmlns:office:1.0"
# Elements whose content is not the text a reader reads where they stand.
SKIPPED = {
    (TEXT, "tracked-changes"),  # deleted text of tracked changes
    (TEXT, "table-of-content"),
    (TEXT, "sequence-decls"),
    (TEXT, "note-citation"),  # the footnote's number; its body follows in brackets
    (OFFICE, "annotation"),  # comments in the margin
    (OFFICE, "annotation-end"),
}
# Most spaces one ``text:s`` stands for: text is read with its spacing collapsed anyway.
MAX_SPACES = 8


def odt_document(
    filename: str, data: bytes, limits: ParseLimits, keep_hidden_text: bool = False
) -> tuple[str, str, dict[str, Any], int]:
    """(text, title, structure, 0) of an OpenDocument text file."""
    from odf import dc
    from odf.opendocument import load

    check_zip(filename, data, limits, kind="ODT")
    with reading(filename, "ODT"):
        doc = load(io.BytesIO(data))
        titles = doc.meta.getElementsByType(dc.Title) if doc.meta is not None else []
        title = " ".join(_inline(titles[0]).split()) if titles else ""
        lines: list[str] = []
        _blocks(doc.text, lines, CellBudget(filename, limits.max_cells))
    return fix_characters(_tidy("\n".join(lines))), title, {}, 0


def _elements(el: Any) -> list[Any]:
    return [c for c in el.childNodes if c.nodeType == c.ELEMENT_NODE and c.qname not in SKIPPED]


def _inline(el: Any) -> str:
    """The text of a paragraph (or any element), as it reads: ``text:s``, tabs and line breaks
    spelled out, footnotes in brackets."""
    out: list[str] = []
    for child in el.childNodes:
        if child.nodeType == child.TEXT_NODE:
            out.append(child.data)
            continue
        if child.nodeType != child.ELEMENT_NODE or child.qname in SKIPPED:
            continue
        name = child.qname
        if name == (TEXT, "line-break"):
            out.append("\n")
        elif name == (TEXT, "tab"):
            out.append("\t")
        elif name == (TEXT, "s"):
            count = child.getAttribute("c")
            out.append(" " * min(int(count) if count and count.isdigit() else 1, MAX_SPACES))
        elif name == (TEXT, "note"):
            body = " ".join(_inline(child).split())
            out.append(f" [{body}]" if body else "")
        elif name in ((TEXT, "p"), (TEXT, "h")):
            out.append("\n" + _inline(child) + "\n")  # a frame's or cell's paragraphs
        else:
            out.append(_inline(child))
    return "".join(out)


def _blocks(el: Any, lines: list[str], budget: CellBudget, depth: int = 0) -> None:
    for child in _elements(el):
        name = child.qname
        if name == (TEXT, "h"):
            level = child.getAttribute("outlinelevel") or "1"
            hashes = "#" * min(max(int(level) if level.isdigit() else 1, 1), 6)
            text = " ".join(_inline(child).split())
            if text:
                lines += ["", f"{hashes} {text}", ""]
        elif name == (TEXT, "p"):
            lines += [body_text(_inline(child).strip("\n")), ""]
        elif name == (TEXT, "list"):
            _list(child, lines, budget, depth)
            lines.append("")
        elif name == (TABLE, "table"):
            lines += ["", markdown_table(used_range(_table_rows(child, budget))), ""]
        else:  # sections, page breaks, frames: what they hold, where they stand
            _blocks(child, lines, budget, depth)


def _list(el: Any, lines: list[str], budget: CellBudget, depth: int) -> None:
    indent = "  " * depth
    for item in _elements(el):
        if item.qname not in ((TEXT, "list-item"), (TEXT, "list-header")):
            continue
        first = True
        for child in _elements(item):
            if child.qname == (TEXT, "list"):
                _list(child, lines, budget, depth + 1)
            elif child.qname in ((TEXT, "p"), (TEXT, "h")):
                text = " ".join(_inline(child).split())
                if text:
                    lines.append(f"{indent}{'- ' if first else '  '}{text}")
                    first = False
            else:
                _blocks(child, lines, budget, depth + 1)


def _table_rows(table: Any, budget: CellBudget) -> list[list[str]]:
    rows: list[list[str]] = []
    for row in _rows_of(table):
        cells: list[str] = []
        empty_run = 0  # empty cells not written yet: trailing ones never are
        for cell in _elements(row):
            if cell.qname not in ((TABLE, "table-cell"), (TABLE, "covered-table-cell")):
                continue
            repeat = _count(cell.getAttribute("numbercolumnsrepeated"))
            text = " ".join(_inline(cell).split())
            if not text:
                empty_run += repeat
                continue
            budget.take(empty_run + repeat)
            cells += [""] * empty_run + [text] * repeat
            empty_run = 0
        if cells:
            repeat = _count(row.getAttribute("numberrowsrepeated"))
            budget.take(len(cells) * (repeat - 1))
            rows += [cells] * repeat
    return rows


def _rows_of(el: Any) -> list[Any]:
    """A table's rows in order, inside header-rows, row groups and the like."""
    out = []
    for child in _elements(el):
        if child.qname == (TABLE, "table-row"):
            out.append(child)
        elif child.qname in ((TABLE, "table-header-rows"), (TABLE, "table-rows"), (TABLE, "table-row-group")):
            out += _rows_of(child)
    return out


def _count(value: str | None) -> int:
    return max(int(value), 1) if value and value.isdigit() else 1
