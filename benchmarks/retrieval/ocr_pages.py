"""OCR of a born-digital PDF's pages against their own text layer: seconds a page and character
accuracy, for choosing TANDEM_RETRIEVAL_OCR_DPI (and ``ocr.DETECT_SIDE``).

    python -m benchmarks.retrieval.ocr_pages --pdf PATH [--pages 9,16,23] [--dpi 150,200,300]
        [--detect-side 1280] [--json OUT]

Each page goes through ``ocr_pdf_pages`` as the worker runs it (rendered by pypdfium2 at the
dpi, detection, recognition, reading order), in this process after the engine is loaded.
Accuracy is ``difflib.SequenceMatcher(None, layer, ocr).ratio()`` of the page's text layer
(pypdfium2) and the OCR'd lines, both with runs of white space as one space; "letters" is the
same without any spaces (how much of the difference is only spacing). Time is wall-clock and
CPU seconds (all threads) a page.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def measure(pdf: Path, pages: list[int], dpi: int, detect_side: int) -> dict[str, Any]:
    import pypdfium2 as pdfium

    from services.retrieval.core import ocr

    ocr.DETECT_SIDE = detect_side
    data = pdf.read_bytes()
    doc = pdfium.PdfDocument(data)
    ocr._engine()  # loaded before the clock starts, as the worker loads it before a page's
    rows = []
    for n in pages:
        textpage = doc[n - 1].get_textpage()
        layer = _flat(textpage.get_text_range())
        textpage.close()
        wall, cpu = time.perf_counter(), time.process_time()
        [page] = ocr.ocr_pdf_pages(data, [n], ocr.OcrSettings(dpi=dpi, page_timeout_s=3600))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        got = _flat(" ".join(line.text for line in page.lines))
        rows.append(
            {
                "page": n,
                "wall_s": round(wall, 2),
                "cpu_s": round(cpu, 2),
                "lines": len(page.lines),
                "accuracy": round(difflib.SequenceMatcher(None, layer, got, autojunk=False).ratio(), 4),
                "letters": round(
                    difflib.SequenceMatcher(
                        None, layer.replace(" ", ""), got.replace(" ", ""), autojunk=False
                    ).ratio(),
                    4,
                ),
                "error": page.error,
            }
        )
    doc.close()
    return {
        "dpi": dpi,
        "detect_side": detect_side,
        "wall_s_per_page": round(statistics.mean(r["wall_s"] for r in rows), 2),
        "cpu_s_per_page": round(statistics.mean(r["cpu_s"] for r in rows), 2),
        "accuracy": round(statistics.mean(r["accuracy"] for r in rows), 4),
        "letters": round(statistics.mean(r["letters"] for r in rows), 4),
        "pages": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--pdf", type=Path, required=True, help="a born-digital PDF (its text layer is the truth)"
    )
    ap.add_argument("--pages", default="9,16,23", help="1-based pages, comma-separated")
    ap.add_argument("--dpi", default="200", help="render resolutions to compare, comma-separated")
    ap.add_argument("--detect-side", default="1280", help="detection image sides to compare, comma-separated")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()
    pages = [int(p) for p in args.pages.split(",")]
    out = []
    for dpi in (int(d) for d in args.dpi.split(",")):
        for side in (int(s) for s in args.detect_side.split(",")):
            row = measure(args.pdf, pages, dpi, side)
            out.append(row)
            print(
                f"dpi {dpi:4d}  detect side {side:5d}  {row['wall_s_per_page']:6.2f} s/page wall  "
                f"{row['cpu_s_per_page']:6.2f} s/page cpu  accuracy {row['accuracy']:.4f}  "
                f"letters {row['letters']:.4f}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
