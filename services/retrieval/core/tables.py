"""Tables as Markdown, the one form every parser gives them: a header row, its ``| --- |`` line,
then the rows, one ``| a | b |`` line each, all with as many cells as the widest row. The
chunker (services/common/chunking.py) keeps such a table whole, or cuts it between rows and
repeats the header row and its ``| --- |`` line with every piece.

What the parsers of tabular files share lives here too: the text of a cell's value, the
trimming of a sheet to its used range, and ``CellBudget``, the count of cells a file may
hold (``TANDEM_RETRIEVAL_PARSE_MAX_CELLS``).
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from decimal import Decimal

_SPACE = re.compile(r"\s+")


def cell_text(value: object) -> str:
    """A cell's value as a reader sees it: numbers without a needless ``.0``, dates in ISO form
    (without a midnight time), booleans as spreadsheets write them, nothing for an empty cell."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    if isinstance(value, Decimal):
        return format(value.normalize(), "f") if value == value.to_integral() else str(value)
    if isinstance(value, dt.datetime):
        if value.time() == dt.time(0):
            return value.date().isoformat()
        return value.isoformat(sep=" ", timespec="seconds" if not value.microsecond else "auto")
    if isinstance(value, dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return str(value)
    return str(value)


def _cell(text: str) -> str:
    return _SPACE.sub(" ", text).strip().replace("|", "\\|")


def markdown_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    """``rows`` (the first is the header) as a Markdown table; "" when there are none."""
    if not rows:
        return ""
    width = max(1, *(len(r) for r in rows))
    lines = [markdown_row([*r, *[""] * (width - len(r))]) for r in rows]
    lines.insert(1, "| " + " | ".join(["---"] * width) + " |")
    return "\n".join(lines)


def used_range(rows: Sequence[Sequence[str]]) -> list[list[str]]:
    """The rows of a sheet that hold anything, cut to the columns that hold anything: its first
    non-empty row becomes the header; empty rows between are dropped."""
    kept = [list(r) for r in rows if any(c.strip() for c in r)]
    if not kept:
        return []
    used = [i for r in kept for i, c in enumerate(r) if c.strip()]
    lo, hi = min(used), max(used) + 1
    return [r[lo:hi] for r in kept]


class CellBudget:
    """The cells a file may hold in all its sheets and tables; one past the limit is an error
    naming the file and the count."""

    def __init__(self, filename: str, max_cells: int) -> None:
        self.filename = filename
        self.max_cells = max_cells
        self.cells = 0

    def take(self, n: int) -> None:
        self.cells += n
        if self.cells > self.max_cells:
            from services.retrieval.core.parsing import ParseLimitError

            raise ParseLimitError(
                f"file {self.filename!r}: more than {self.max_cells:,} table cells "
                f"({self.cells:,} read so far) (limit set by TANDEM_RETRIEVAL_PARSE_MAX_CELLS)",
                param="file",
                code="parse_limit_exceeded",
            )
