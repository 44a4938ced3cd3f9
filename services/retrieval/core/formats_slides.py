"""PowerPoint decks (.pptx, read with python-pptx) as documents, slide by slide.

Each slide opens with a heading, ``# Slide N: <its title>`` (``# Slide N`` without one), so a
chunk never spans two slides and its heading path names the slide. Then come the slide's
shapes in the order a reader scans them (top to bottom, left to right; a group's shapes where
the group stands): text frames a paragraph a line (indented levels as list items), tables and
charts' data as Markdown tables (core/tables.py), and last the speaker notes as ``Notes: ...``.
``structure["pages"]`` holds where each slide begins, with the slide numbers as pages, so a
citation names its slide as it names a PDF's page.

A hidden slide is left out unless the collection keeps hidden text, and counted as hidden.
"""

from __future__ import annotations

import io
from typing import Any

from services.common.chunking import body_text
from services.retrieval.core.format_errors import check_text_size, reading
from services.retrieval.core.parsing import ParseLimits, _limit, _tidy, check_zip
from services.retrieval.core.tables import CellBudget, cell_text, markdown_table
from services.retrieval.core.text_cleanup import fix_characters


def pptx_document(
    filename: str, data: bytes, limits: ParseLimits, keep_hidden_text: bool = False
) -> tuple[str, str, dict[str, Any], int]:
    """(text, title, structure, hidden slides) of a deck."""
    from pptx import Presentation

    check_zip(filename, data, limits, kind="PPTX")
    budget = CellBudget(filename, limits.max_cells)
    with reading(filename, "PPTX"):
        deck = Presentation(io.BytesIO(data))
        slides = list(deck.slides)
        if len(slides) > limits.max_pages:
            raise _limit(filename, f"{len(slides)} slides, more than {limits.max_pages}", "PARSE_MAX_PAGES")
        title = (deck.core_properties.title or "").strip()
        parts: list[str] = []
        pages: list[list[int]] = []
        hidden = size = pos = 0
        for number, slide in enumerate(slides, start=1):
            if slide.element.get("show") in ("0", "false") and not keep_hidden_text:
                hidden += 1
                continue
            body = fix_characters(_tidy(_slide_text(slide, number, budget)))
            if parts:
                pos += 2  # the blank line between slides
            pages.append([number, pos])
            parts.append(body)
            pos += len(body)
            size += len(body)
            check_text_size(filename, size, limits)
            if not title:
                title = _title_of(slide)
    structure: dict[str, Any] = {"pages": pages} if pages else {}
    return "\n\n".join(parts), title, structure, hidden


def _title_of(slide: Any) -> str:
    shape = slide.shapes.title
    if shape is None or not shape.has_text_frame:
        return ""
    return " ".join(shape.text_frame.text.split())


def _slide_text(slide: Any, number: int, budget: CellBudget) -> str:
    title = _title_of(slide)
    lines = [f"# Slide {number}: {title}" if title else f"# Slide {number}", ""]
    title_id = slide.shapes.title.shape_id if slide.shapes.title is not None else None
    for shape in _reading_order(slide.shapes):
        if shape.shape_id == title_id:
            continue  # it is the heading
        block = _shape_text(shape, budget)
        if block.strip():
            lines += [body_text(block), ""]
    if slide.has_notes_slide:
        frame = slide.notes_slide.notes_text_frame
        notes = frame.text.replace("\v", "\n").strip() if frame is not None else ""
        if notes:
            lines.append(body_text(f"Notes: {notes}"))
    return "\n".join(lines)


def _reading_order(shapes: Any) -> list[Any]:
    """Top to bottom, then left to right; shapes without a position keep their order, last."""
    placed = [s for s in shapes if s.top is not None and s.left is not None]
    unplaced = [s for s in shapes if s.top is None or s.left is None]
    return sorted(placed, key=lambda s: (int(s.top), int(s.left))) + unplaced


def _shape_text(shape: Any, budget: CellBudget) -> str:
    from pptx.enum.shapes import MSO_SHAPE_TYPE

    if shape.shape_type == MSO_SHAPE_TYPE.GROUP:
        return "\n\n".join(
            t for t in (_shape_text(s, budget) for s in _reading_order(shape.shapes)) if t.strip()
        )
    if shape.has_table:
        rows = [[cell.text.replace("\v", " ") for cell in row.cells] for row in shape.table.rows]
        budget.take(sum(len(r) for r in rows))
        return markdown_table(rows)
    if shape.has_chart:
        return _chart_table(shape.chart, budget)
    if shape.has_text_frame:
        out = []
        for para in shape.text_frame.paragraphs:
            text = para.text.replace("\v", "\n").strip()
            if text:
                out.append(("  " * (para.level - 1) + "- " + text) if para.level else text)
        return "\n".join(out)
    return ""


def _chart_table(chart: Any, budget: CellBudget) -> str:
    """A chart's title and its data: a row per category, a column per series."""
    title = ""
    if chart.has_title and chart.chart_title.has_text_frame:
        title = " ".join(chart.chart_title.text_frame.text.split())
    series = [s for plot in chart.plots for s in plot.series]
    if not series:
        return title
    categories = [cell_text(c) for c in chart.plots[0].categories]
    values = [list(s.values) for s in series]
    length = max(len(categories), *(len(v) for v in values))
    budget.take(length * (len(series) + 1))
    rows = [["", *(s.name or "" for s in series)]]
    for i in range(length):
        label = categories[i] if i < len(categories) else ""
        rows.append([label, *(cell_text(v[i]) if i < len(v) else "" for v in values)])
    table = markdown_table(rows)
    return f"{title}\n\n{table}" if title else table
