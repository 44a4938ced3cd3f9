"""Small real documents made in tests: a PDF of three pages with headings, and a page of lines
in given fonts (reportlab)."""

from __future__ import annotations

import io
from collections.abc import Sequence

# (heading, sentences) of each page of ``solar_pdf``; the first page also has the title.
SOLAR_TITLE = "Solar System Guide"
SOLAR_PAGES = [
    ("Overview", ["The Sun is a star at the centre of the system.", "Eight planets orbit the Sun."]),
    (
        "Jupiter",
        ["Jupiter is the largest planet of all.", "Its Great Red Spot is a storm larger than Earth."],
    ),
    ("Saturn", ["Saturn has bright rings made of ice.", "Titan is the largest moon of Saturn."]),
]


def solar_pdf(running: bool = False) -> bytes:
    """Three A4 pages: a 22 pt title, a 16 pt heading on each page, 11 pt body lines; with
    ``running``, a running head ("Solar guide: the planets N") and the page number at the foot,
    as printed manuals have them."""
    from reportlab.lib.pagesizes import A4
    from reportlab.pdfgen import canvas

    buf = io.BytesIO()
    c = canvas.Canvas(buf, pagesize=A4)
    for n, (heading, lines) in enumerate(SOLAR_PAGES):
        y = 780.0
        if running:
            c.setFont("Helvetica", 9)
            c.drawString(72, 810, f"Solar guide: the planets {n + 1}")
        if n == 0:
            c.setFont("Helvetica-Bold", 22)
            c.drawString(72, y, SOLAR_TITLE)
            y -= 40
        c.setFont("Helvetica-Bold", 16)
        c.drawString(72, y, heading)
        y -= 26
        c.setFont("Helvetica", 11)
        for line in lines:
            c.drawString(72, y, line)
            y -= 16
        if running:
            c.setFont("Helvetica", 9)
            c.drawString(290, 40, str(n + 1))
        c.showPage()
    c.save()
    return buf.getvalue()


def lines_pdf(lines: Sequence[tuple[str, float, float, str]], x: float = 72) -> bytes:
    """One A4 page: each ``(font, size, y, text)`` drawn as a line at ``x`` (points from the
    page's bottom)."""
    from reportlab.lib.pagesizes import A4
    from reportlab.pdfgen import canvas

    buf = io.BytesIO()
    c = canvas.Canvas(buf, pagesize=A4)
    for font, size, y, text in lines:
        c.setFont(font, size)
        c.drawString(x, y, text)
    c.showPage()
    c.save()
    return buf.getvalue()
