"""The cited line drawn from the boxes the parser stored with the chunk, in a real browser (Debian
chromium), the APIs doubled: over a born-digital PDF page (pdf.js), over a scan of it that has no
text layer (where finding the sentence's text on the page cannot work), and over an image, each
box scaled from page units to the drawn page. A citation without boxes keeps the text search."""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from typing import Any

import pytest

from services.common.chunking import Section
from services.retrieval.core.parsing import parse_file
from services.retrieval.core.structure import chunk_structure
from tests.helpers.documents import solar_pdf
from tests.web.test_frontend import BASE_ROUTES, double_api, sign_in, site  # noqa: F401

SENTENCE = "Its Great Red Spot is a storm larger than Earth."
# pdf.js draws the page at this scale (services/agent/web/src/pdfview.ts)
SCALE = 1.25


def citation(
    text: str, chunk_start: int, start: int, doc_id: str, page: int, **located: Any
) -> dict[str, Any]:
    end = start + len(SENTENCE)
    return {
        "index": 1,
        "chunk_id": "c2",
        "document_id": doc_id,
        "title": doc_id,
        "text": text,
        "start": chunk_start,
        "end": chunk_start + len(text),
        "kind": "cited",
        "page": page,
        "span": {"start": start, "end": end, "text": SENTENCE},
        **located,
    }


def solar_citation(doc_id: str) -> tuple[dict[str, Any], list[float], str]:
    """The citation of SENTENCE as the agent makes it from a retrieval hit of the real parser's
    chunk (its boxes as chunk_structure stores them); the sentence's own box; the document text."""
    doc = parse_file("solar.pdf", solar_pdf())[0]
    start = doc.text.index(SENTENCE)
    chunk_start = doc.text.index("## Jupiter")
    chunk_end = start + len(SENTENCE)
    stored = chunk_structure(doc.structure, chunk_start, chunk_end, Section(chunk_start, chunk_end, ()))
    boxes, sizes = stored["boxes"], stored["page_sizes"]
    rel = start - chunk_start
    (line,) = [b for b in boxes if b[0] <= rel < b[1]]
    assert line[2] == 2 and [s for s in sizes if s[0] == 2]
    cite = citation(
        doc.text[chunk_start:chunk_end], chunk_start, start, doc_id, 2, boxes=boxes, page_sizes=sizes
    )
    return cite, line, doc.text


def scanned(pdf: bytes) -> bytes:
    """The PDF as a scan: each page an image (no text layer), at the same page size."""
    import pypdfium2 as pdfium
    from PIL import Image

    src = pdfium.PdfDocument(pdf)
    images: list[Image.Image] = []
    for i in range(len(src)):
        images.append(src[i].render(scale=150 / 72).to_pil().convert("RGB"))
    width_pt = src[0].get_width()
    out = io.BytesIO()
    images[0].save(
        out, format="PDF", save_all=True, append_images=images[1:], resolution=images[0].width * 72 / width_pt
    )
    return out.getvalue()


def page_size(pdf: bytes, page: int) -> tuple[float, float]:
    import pypdfium2 as pdfium

    doc = pdfium.PdfDocument(pdf)
    try:
        return doc[page - 1].get_size()
    finally:
        doc.close()


def open_citation(
    page: Any, url: str, cite: dict[str, Any], original: tuple[str, bytes], doc_text: str | None
) -> Any:
    conversation = {
        "id": "c-1",
        "messages": [
            {"role": "user", "content": "What is the Great Red Spot?"},
            {"role": "assistant", "content": "A storm larger than Earth [1].", "citations": [cite]},
        ],
    }
    doc_id = cite["document_id"]
    routes = {**BASE_ROUTES, r"GET /v1/conversations/c-1": lambda r: (200, conversation)}
    if doc_text is not None:
        routes[rf"GET /api/retrieval/v1/collections/handbook/documents/{re.escape(doc_id)}"] = lambda r: (
            200,
            {"id": doc_id, "text": doc_text},
        )
    double_api(page, routes)
    asked: list[str] = []

    def serve(route: Any) -> None:
        asked.append(route.request.url)
        route.fulfill(status=200, content_type=original[0], body=original[1])

    page.route(
        re.compile(rf".*/api/retrieval/v1/collections/handbook/originals/{re.escape(doc_id)}(\?.*)?$"), serve
    )
    sign_in(page, url)
    page.goto(f"{url}/#/chat/c-1")
    page.locator(".chip").click()
    dialog = page.get_by_role("dialog")
    dialog.wait_for()
    page.wait_for_function("document.querySelector('.pdf-page[data-highlight]') !== null", timeout=30_000)
    assert asked and asked[-1].endswith(f"?page={cite['page']}")
    return dialog


def drawn(dialog: Any) -> list[dict[str, float]]:
    return dialog.locator(".box-hit").evaluate_all(
        """els => els.map(e => ({left: parseFloat(e.style.left), top: parseFloat(e.style.top),
                                 width: parseFloat(e.style.width), height: parseFloat(e.style.height),
                                 page: Number(e.dataset.page)}))"""
    )


def assert_at(hit: dict[str, float], box: Sequence[float], sx: float, sy: float) -> None:
    _, _, page, x0, top, x1, bottom = box
    assert hit["page"] == page
    assert hit["left"] == pytest.approx(x0 * sx, abs=0.01) and hit["top"] == pytest.approx(top * sy, abs=0.01)
    assert hit["width"] == pytest.approx((x1 - x0) * sx, abs=0.01)
    assert hit["height"] == pytest.approx((bottom - top) * sy, abs=0.01)


def inked(page: Any) -> int:
    """Dark pixels on the drawn page: it was drawn, not left blank."""
    return int(
        page.evaluate(
            """() => { const c = document.querySelector('.pdf-canvas');
                       const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                       let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i] < 128) n++; return n; }"""
        )
    )


@pytest.mark.parametrize("scan", [False, True], ids=["born-digital", "scanned"])
def test_the_cited_pdf_line_is_drawn_from_its_box(page: Any, site: str, scan: bool) -> None:  # noqa: F811
    cite, line, text = solar_citation("solar.pdf")
    pdf = scanned(solar_pdf()) if scan else solar_pdf()
    dialog = open_citation(page, site, cite, ("application/pdf", pdf), text)
    layer = dialog.locator(".pdf-page")
    assert layer.get_attribute("data-highlight") == "boxes" and layer.get_attribute("data-page") == "2"
    hits = drawn(dialog)
    assert len(hits) == 1  # the sentence's line only: not the heading or the line before
    # page units to pixels: the page as pdf.js draws it (the scan's page is a hair off A4's size)
    drawn_w, drawn_h = page_size(pdf, 2)
    _, width, height = next(s for s in cite["page_sizes"] if s[0] == 2)
    assert_at(hits[0], line, drawn_w * SCALE / width, drawn_h * SCALE / height)
    # the box sits on the page as drawn: inside the canvas, in its upper part (the text's place)
    size = page.evaluate(
        "() => { const c = document.querySelector('.pdf-canvas'); return [c.width, c.height]; }"
    )
    assert 0 < hits[0]["left"] < size[0] and 0 < hits[0]["top"] < size[1] / 3
    assert inked(page) > 100
    page.wait_for_function(f"document.querySelector('mark.cited')?.textContent === {SENTENCE!r}")
    assert page.page_errors == []


def test_without_boxes_the_sentence_is_found_in_the_text_runs(page: Any, site: str) -> None:  # noqa: F811
    cite, _, text = solar_citation("solar.pdf")
    del cite["boxes"], cite["page_sizes"]
    dialog = open_citation(page, site, cite, ("application/pdf", solar_pdf()), text)
    page.wait_for_function("document.querySelectorAll('.pdf-hit').length > 0")
    assert dialog.locator(".pdf-page").get_attribute("data-highlight") == "text"
    assert dialog.locator(".box-hit").count() == 0
    assert "Great Red Spot" in " ".join(
        dialog.locator(".pdf-hit").evaluate_all("els => els.map(e => e.dataset.text)")
    )


def test_an_image_source_is_drawn_with_its_boxes(page: Any, site: str) -> None:  # noqa: F811
    from tests.retrieval.test_ocr import page_image

    # a photographed page, 1600 px wide (wider than the dialog: drawn scaled down), read by OCR
    img, _ = page_image(
        [(100, 100, "Jupiter is the largest planet of all."), (100, 200, SENTENCE)], (1600, 1000), px=40
    )
    png = io.BytesIO()
    img.save(png, format="PNG")
    doc = parse_file("scan.png", png.getvalue())[0]
    stored = chunk_structure(doc.structure, 0, len(doc.text), Section(0, len(doc.text), ()))
    assert stored["page_sizes"] == [[1, 1600, 1000]]
    second = next(b for b in stored["boxes"] if b[4] > 150)  # the line drawn at y=200
    start, end = int(second[0]), int(second[1])
    cite = citation(doc.text, 0, start, "scan.png", 1, boxes=stored["boxes"], page_sizes=stored["page_sizes"])
    cite["span"] = {"start": start, "end": end, "text": doc.text[start:end]}
    dialog = open_citation(page, site, cite, ("image/png", png.getvalue()), None)
    canvas = page.evaluate(
        "() => { const c = document.querySelector('.image-canvas'); return [c.width, c.height]; }"
    )
    assert 320 <= canvas[0] < 1600 and canvas[1] == round(1000 * canvas[0] / 1600)
    assert dialog.locator(".pdf-page").get_attribute("data-highlight") == "boxes"
    hits = drawn(dialog)
    assert len(hits) == 1  # the cited line, not the one above it
    assert_at(hits[0], second, canvas[0] / 1600, canvas[1] / 1000)
    assert inked(page) > 1000  # the image itself was drawn under the box
    assert page.page_errors == []
