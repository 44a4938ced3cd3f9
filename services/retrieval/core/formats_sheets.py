"""Spreadsheets as documents: Excel workbooks (.xlsx, read with openpyxl, the values their
formulas last computed) sheet by sheet, and CSV/TSV files (the csv module, its dialect sniffed).

Each sheet is a heading, ``# Sheet: <name>`` (a CSV file has one sheet and no heading: its name
is the document's), and its used range as a Markdown table whose first non-empty row is the
header (core/tables.py), so that the chunker cuts a long sheet between rows and repeats the
header with each piece. Empty rows, and columns empty in every row at either side, are left
out. A file holds at most ``TANDEM_RETRIEVAL_PARSE_MAX_CELLS`` cells in all its sheets. A hidden
sheet is left out unless the collection keeps hidden text, and counted as hidden.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from services.retrieval.core.format_errors import check_text_size, reading, unreadable
from services.retrieval.core.parsing import ParseLimits, _decode, check_zip
from services.retrieval.core.tables import CellBudget, cell_text, markdown_table, used_range
from services.retrieval.core.text_cleanup import fix_characters

# How much of a CSV file the dialect is guessed from.
SNIFF_CHARS = 64 * 1024


def xlsx_document(
    filename: str, data: bytes, limits: ParseLimits, keep_hidden_text: bool = False
) -> tuple[str, str, dict[str, Any], int]:
    """(text, title, structure, hidden sheets) of a workbook."""
    from openpyxl import load_workbook

    check_zip(filename, data, limits, kind="XLSX")
    budget = CellBudget(filename, limits.max_cells)
    parts: list[str] = []
    hidden = size = 0
    with reading(filename, "XLSX"):
        book = load_workbook(io.BytesIO(data), read_only=True, data_only=True)
        try:
            title = (book.properties.title or "").strip() if book.properties else ""
            for sheet in book.worksheets:
                if sheet.sheet_state != "visible" and not keep_hidden_text:
                    hidden += 1
                    continue
                # The dimension a file declares may be anything ("A1:XFD1048576"): read the
                # cells that are there, not the range it claims.
                sheet.reset_dimensions()
                rows: list[list[str]] = []
                for row in sheet.iter_rows(values_only=True):
                    budget.take(len(row))
                    rows.append([cell_text(v) for v in row])
                table = markdown_table(used_range(rows))
                if table:
                    parts.append(f"# Sheet: {sheet.title}\n\n{table}")
                    size += len(table)
                    check_text_size(filename, size, limits)
        finally:
            book.close()
    return fix_characters("\n\n".join(parts)), title, {}, hidden


def csv_document(
    filename: str, data: bytes, limits: ParseLimits, keep_hidden_text: bool = False
) -> tuple[str, str, dict[str, Any], int]:
    """(text, title, structure, 0) of a CSV or TSV file (UTF-8, with or without a BOM)."""
    text = _decode(filename, data)
    tab = filename.lower().endswith(".tsv")
    try:
        dialect: Any = csv.Sniffer().sniff(text[:SNIFF_CHARS], delimiters="\t" if tab else ",;\t|")
    except csv.Error:  # one column, or too few rows to tell: the format's own default
        dialect = csv.excel_tab if tab else csv.excel
    budget = CellBudget(filename, limits.max_cells)
    rows: list[list[str]] = []
    reader = csv.reader(io.StringIO(text, newline=""), dialect)
    try:
        for row in reader:
            budget.take(len(row))
            rows.append(row)
    except csv.Error as exc:
        raise unreadable(filename, "CSV", f"line {reader.line_num}: {exc}") from None
    return fix_characters(markdown_table(used_range(rows))), "", {}, 0
