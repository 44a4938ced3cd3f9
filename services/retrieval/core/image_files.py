"""PNG, JPEG and TIFF files as documents: each page (a TIFF's frames are pages) read by OCR
(core/ocr.py) and put together as the OCR'd pages of a scanned PDF are (``parsing.compose_pages``):
lines in reading order, words hyphenated at a line end joined, a running head or foot on three
pages or more left out. ``structure`` has the ``pages``, ``lines`` and ``page_sizes`` a PDF's
has, in pixels of the image as it is shown (a JPEG turned as its EXIF orientation says).
"""

from __future__ import annotations

from services.retrieval.core.ocr import OcrSettings, ocr_image
from services.retrieval.core.parsing import ParseLimits, PdfText, compose_pages
from services.retrieval.core.pdf_layout import ocr_layout


def image_document(filename: str, data: bytes, limits: ParseLimits, ocr: OcrSettings) -> PdfText:
    """The text of an image file; the pages that yield none are ``pages_without_text`` and why
    OCR read nothing on a page (past its time or pixel limit, undecodable) is ``page_errors``."""
    pages = ocr_image(filename, data, ocr, max_pages=limits.max_pages)
    layouts = [ocr_layout(p.page, p.width, p.height, [(ln.text, ln.box) for ln in p.lines]) for p in pages]
    out = compose_pages(layouts)
    out.pages_without_text = [p.number for p in layouts if not p.has_text]
    out.page_errors = {p.page: p.error for p in pages if p.error and p.page in out.pages_without_text}
    return out
