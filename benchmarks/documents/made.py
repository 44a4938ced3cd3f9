"""Documents made from real ones, as people have them: a PDF scanned to page images, and HTML
documentation printed in two columns by a real browser.

- ``scan_pdf``: each page rendered with pypdfium2 at ``dpi`` (200, as an office scanner does;
  Debian's ``pdftoppm`` needs poppler-utils, which cannot be installed here without root), in
  grey, saved by Pillow as a PDF of JPEG images: no text layer, every page the size of the
  original's.
- ``print_two_columns``: an HTML page printed to PDF by Debian's chromium through Playwright (the
  browser the web tests drive; Playwright never downloads one) with the page's text set in two
  columns (CSS ``column-count: 2``), A4. No listed package ships a two-column PDF
  (benchmarks/documents/README.md), so this is the nearest real thing: real documentation, laid
  out by a real layout engine, as a paper's two columns are.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

CHROMIUM = Path(os.environ.get("TANDEM_TEST_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
]
# The page's text in two columns; headings, code and tables stay in their column, and a figure
# or table wider than a column is scaled to it rather than cut.
TWO_COLUMNS_CSS = """
@page { size: A4; margin: 18mm 15mm; }
body { column-count: 2; column-gap: 9mm; font-size: 10pt; margin: 0; }
pre, table, img { max-width: 100%; }
pre { white-space: pre-wrap; word-break: break-word; }
table { table-layout: fixed; word-break: break-word; }
.navheader, .navfooter { display: none; }
"""


def scan_pdf(src: Path, dst: Path, dpi: int = 200) -> int:
    """Writes ``dst``: ``src``'s pages as grey JPEG images at ``dpi``, no text. Returns the page count."""
    import pypdfium2 as pdfium

    pdf = pdfium.PdfDocument(str(src))
    try:
        images = []
        for page in pdf:
            bitmap = page.render(scale=dpi / 72, grayscale=True)
            images.append(bitmap.to_pil().convert("L"))
            page.close()
    finally:
        pdf.close()
    if not images:
        raise ValueError(f"{src}: no pages")
    dst.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    # Pillow writes each page at ``resolution`` dpi, so a page keeps its size in points.
    images[0].save(buf, "PDF", resolution=float(dpi), save_all=True, append_images=images[1:], quality=85)
    dst.write_bytes(buf.getvalue())
    return len(images)


def print_two_columns(html_pages: list[Path], out_dir: Path) -> list[Path]:
    """Each HTML page printed to ``out_dir/<stem>.pdf`` in two columns by Debian's chromium."""
    if not CHROMIUM.exists():
        raise SystemExit(f"Debian chromium is not installed at {CHROMIUM} (run `make browser`)")
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    from playwright.sync_api import sync_playwright

    out_dir.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            for html in html_pages:
                page.goto(html.resolve().as_uri(), wait_until="load")
                page.add_style_tag(content=TWO_COLUMNS_CSS)
                dst = out_dir / f"{html.stem}.pdf"
                page.pdf(path=str(dst), format="A4", print_background=False, prefer_css_page_size=True)
                made.append(dst)
        finally:
            browser.close()
    return made
