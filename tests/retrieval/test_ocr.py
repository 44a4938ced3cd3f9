"""OCR of images and scanned PDF pages (services/retrieval/core/ocr.py): real images drawn with
Pillow and read by RapidOCR's shipped models, in reading order with their boxes; PNG, JPEG and
TIFF files as documents; a scanned PDF uploaded, ingested by a job and found by search with its
page and line boxes; a page past its time limit failing alone, with its reason; pages without
text on the job; and the collection's ``ocr_language``."""

from __future__ import annotations

import difflib
import io
import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from PIL import Image, ImageDraw, ImageFont

from services.retrieval.core.ocr import OcrSettings, ocr_image, ocr_pdf_pages, render_scale
from services.retrieval.core.parsing import NoTextError, parse_file
from tests.retrieval.conftest import run_queued_job
from tests.retrieval.test_api import make, search

DEJAVU = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")

TITLE = "Owls of the Valley"
LEFT = [
    "Barn owls hunt at night over",
    "open fields and the edges of",
    "woods, where voles run in the",
    "long grass. They hear a vole",
    "move under the snow and drop",
    "on it without a sound at all.",
]
RIGHT = [
    "Tawny owls keep to the woods",
    "and call to each other in the",
    "autumn. A pair holds the same",
    "ground for years and drives",
    "off the young birds when the",
    "summer ends and winter comes.",
]


def font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """DejaVu Sans where the system has it, else Pillow's own scalable font."""
    if DEJAVU.exists():
        return ImageFont.truetype(str(DEJAVU), size)
    return ImageFont.load_default(size=size)


Box = tuple[float, float, float, float]


def page_image(
    lines: list[tuple[int, int, str]], size: tuple[int, int], px: int = 24
) -> tuple[Image.Image, list[Box]]:
    """A white greyscale page with ``(x, y, text)`` lines drawn in black, and each line's box."""
    img = Image.new("L", size, 255)
    draw = ImageDraw.Draw(img)
    f = font(px)
    boxes = []
    for x, y, text in lines:
        draw.text((x, y), text, fill=0, font=f)
        boxes.append(tuple(float(v) for v in draw.textbbox((x, y), text, font=f)))
    return img, boxes  # type: ignore[return-value]


def columns_page() -> tuple[Image.Image, list[str], list[Box]]:
    """A title across the page above two columns of six lines."""
    lines = [(30, 15, TITLE)]
    for i, (left, right) in enumerate(zip(LEFT, RIGHT, strict=True)):
        lines += [(30, 70 + 50 * i, left), (530, 70 + 50 * i, right)]
    img, boxes = page_image(lines, (1000, 400))
    # reading order: the title, the left column, the right one
    order = [0, *range(1, 13, 2), *range(2, 13, 2)]
    return img, [lines[i][2] for i in order], [boxes[i] for i in order]


def letters(text: str) -> str:
    return re.sub(r"\W+", "", text.lower())


def same(got: str, want: str) -> bool:
    """OCR read ``want`` (a letter wrong at most in a line; spaces aside: fonts set them tight)."""
    return difflib.SequenceMatcher(None, letters(got), letters(want)).ratio() >= 0.9


def overlap(a: Box, b: Box) -> float:
    """Intersection over union of two boxes."""
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    if w <= 0 or h <= 0:
        return 0.0
    inter = w * h
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def encoded(img: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def test_a_png_is_read_in_reading_order_with_each_lines_box() -> None:
    img, want, boxes = columns_page()
    [page] = ocr_image("owls.png", encoded(img, "PNG"), OcrSettings())
    assert (page.page, page.width, page.height, page.error) == (1, 1000, 400, "")
    assert len(page.lines) == len(want), [ln.text for ln in page.lines]
    for line, text, box in zip(page.lines, want, boxes, strict=True):
        assert same(line.text, text), (line.text, text)
        assert overlap(line.box, box) > 0.5, (line.text, line.box, box)


def test_an_upside_down_scan_is_read_the_right_way_up() -> None:
    img, boxes = page_image([(20, 20, LEFT[0]), (20, 70, LEFT[1]), (20, 120, LEFT[2])], (480, 180))
    [page] = ocr_image("turned.png", encoded(img.rotate(180), "PNG"), OcrSettings())
    assert len(page.lines) == 3 and all(same(ln.text, t) for ln, t in zip(page.lines, LEFT[:3], strict=True))
    # the boxes are where the lines are on the image as it was uploaded
    w, h = img.size
    turned = (w - boxes[0][2], h - boxes[0][3], w - boxes[0][0], h - boxes[0][1])
    assert overlap(page.lines[0].box, turned) > 0.5


def test_a_jpeg_becomes_a_document_with_line_boxes() -> None:
    img, want, boxes = columns_page()
    [doc] = parse_file("owls.jpg", encoded(img.convert("RGB"), "JPEG", quality=90))
    assert doc.metadata == {"source": "owls.jpg"}
    assert doc.structure["pages"] == [[1, 0]] and doc.structure["page_sizes"] == [[1, 1000, 400]]
    lines = doc.structure["lines"]
    assert len(lines) == len(want)
    for (start, end, page, *box), text, drawn in zip(lines, want, boxes, strict=True):
        assert page == 1 and same(doc.text[start:end], text)
        assert overlap(tuple(box), drawn) > 0.5  # type: ignore[arg-type]
    assert doc.text.index("Tawny") > doc.text.index("without a sound")  # the left column first


def test_each_frame_of_a_tiff_is_a_page() -> None:
    first, _ = page_image([(20, 20, LEFT[0]), (20, 70, LEFT[1])], (480, 130))
    second, _ = page_image([(20, 20, RIGHT[0]), (20, 70, RIGHT[1])], (520, 130))
    data = encoded(first, "TIFF", save_all=True, append_images=[second], compression="tiff_deflate")
    [doc] = parse_file("owls.tiff", data)
    (_, p1), (_, p2) = doc.structure["pages"]
    assert same(doc.text[p1:p2], " ".join(LEFT[:2])) and same(doc.text[p2:], " ".join(RIGHT[:2]))
    assert doc.structure["page_sizes"] == [[1, 480, 130], [2, 520, 130]]
    assert [ln[2] for ln in doc.structure["lines"]] == [1, 1, 2, 2]
    assert doc.structure["lines"][2][0] == p2


def stepping_clock(at: list[float]) -> Callable[[], float]:
    """A clock that reads each of ``at`` in turn, then the last for ever."""
    reads = iter(at)
    last = [0.0]

    def clock() -> float:
        last[0] = next(reads, last[0])
        return last[0]

    return clock


def test_a_page_past_its_time_limit_fails_alone_with_the_reason() -> None:
    first, _ = page_image([(20, 20, LEFT[0])], (480, 80))
    second, _ = page_image([(20, 20, RIGHT[0])], (480, 80))
    data = encoded(first, "TIFF", save_all=True, append_images=[second])
    # page 1 starts at 0 with 60 s, is decoded at 0, and its detection ends at 100: past the
    # limit. Page 2 starts at 100 and is read within its own 60 s.
    clock = stepping_clock([0.0, 0.0, 100.0])
    one, two = ocr_image("owls.tiff", data, OcrSettings(page_timeout_s=60), clock=clock)
    assert one.lines == [] and one.error == "OCR passed its 60 s limit (TANDEM_RETRIEVAL_OCR_PAGE_TIMEOUT_S)"
    assert two.error == "" and same(two.lines[0].text, RIGHT[0])


def test_a_frame_past_the_pixel_limit_is_refused_and_a_pdf_page_rendered_smaller() -> None:
    img, _ = page_image([(20, 20, LEFT[0])], (480, 80))
    [page] = ocr_image("big.png", encoded(img, "PNG"), OcrSettings(max_pixels=480 * 80 - 1))
    assert page.lines == [] and "480 x 80 pixels" in page.error and "OCR_MAX_PIXELS" in page.error
    # an A4 page at 200 dpi is 3.9 million pixels; under a limit of one million, fewer dots a point
    scale = render_scale(595, 842, OcrSettings(dpi=200, max_pixels=1_000_000))
    assert scale < 200 / 72 and 595 * scale * 842 * scale == pytest.approx(1_000_000)


def test_a_blank_image_is_an_error_naming_its_pages() -> None:
    blank = Image.new("L", (300, 200), 255)
    data = encoded(blank, "TIFF", save_all=True, append_images=[blank])
    with pytest.raises(NoTextError) as caught:
        parse_file("blank.tiff", data)
    assert caught.value.pages_without_text == [1, 2]
    assert "no extractable text (pages without text: 1-2)" in caught.value.message
    with pytest.raises(Exception) as bad:
        parse_file("fake.png", b"not an image at all")
    assert "'fake.png' is not a readable PNG, JPEG or TIFF image" in str(bad.value)


def scanned_pdf(pages: list[Image.Image]) -> bytes:
    """An image-only PDF, as a scanner writes one: each page a picture (Pillow's PDF writer)."""
    return encoded(pages[0], "PDF", resolution=100.0, save_all=True, append_images=pages[1:])


def test_a_scanned_pdf_is_ingested_and_found_with_its_page_and_boxes(client: httpx.Client) -> None:
    make(client, chunking={"size": 64, "overlap": 0})
    text_page, _ = page_image(
        [(30, 30, TITLE), *[(30, 90 + 45 * i, t) for i, t in enumerate(LEFT)]], (850, 400)
    )
    blank = Image.new("L", (850, 400), 255)
    r = client.post(
        "/v1/collections/kb/files", files=[("file", ("scan.pdf", scanned_pdf([blank, text_page])))]
    )
    job = run_queued_job(client, r)
    assert job["status"] == "succeeded" and job["file_errors"] == [], job
    assert job["result"]["pages_without_text"] == {"scan.pdf": [1]}
    assert job["result"]["page_errors"] == {}

    hit = search(client, query="voles long grass", mode="sparse", top_k=1)[0]
    assert hit["document_id"] == "scan.pdf" and hit["pages"] == [2]
    assert hit["metadata"]["pages_without_text"] == [1]
    # the page is 850 x 400 pixels at 100 dpi: 612 x 288 points; its lines' boxes are in points
    assert hit["page_sizes"] == [[2, 612.0, 288.0]]
    assert hit["boxes"] and all(b[2] == 2 for b in hit["boxes"])
    for start, end, _page, x0, top, x1, bottom in hit["boxes"]:
        assert 0 <= start < end <= len(hit["text"])
        assert 0 <= x0 < x1 <= 612 and 0 <= top < bottom <= 288
    grass = next(b for b in hit["boxes"] if "grass" in hit["text"][b[0] : b[1]])
    # "long grass. They hear a vole" was drawn at (30, 225) px: (21.6, 162) points
    assert grass[3] == pytest.approx(21.6, abs=4) and grass[4] == pytest.approx(162, abs=6)


@pytest.fixture()
def tiny_ocr_limit(retrieval_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OCR pages may take a millisecond: every page OCR begins passes its limit (set after the
    test settings clear TANDEM_*, before the service reads them)."""
    monkeypatch.setenv("TANDEM_RETRIEVAL_OCR_PAGE_TIMEOUT_S", "0.001")


def test_a_scanned_page_past_its_limit_fails_that_page_not_the_job(
    tiny_ocr_limit: None, client: httpx.Client
) -> None:
    from reportlab.lib.pagesizes import A5
    from reportlab.lib.utils import ImageReader
    from reportlab.pdfgen import canvas

    make(client)
    scan, _ = page_image([(30, 30, RIGHT[0])], (600, 100))
    buf = io.BytesIO()
    pdf = canvas.Canvas(buf, pagesize=A5)
    pdf.setFont("Helvetica", 11)
    pdf.drawString(60, 500, "Barn owls nest in old barns and hollow trees.")
    pdf.showPage()  # page 1: a text layer; page 2: a scanned picture only
    pdf.drawImage(ImageReader(scan), 30, 400, width=360, height=60)
    pdf.showPage()
    pdf.save()
    r = client.post(
        "/v1/collections/kb/files",
        files=[
            ("file", ("mixed.pdf", buf.getvalue())),
            ("file", ("blank.png", encoded(Image.new("L", (200, 100), 255), "PNG"))),
        ],
    )
    job = run_queued_job(client, r)
    assert job["status"] == "succeeded", job
    reason = "OCR passed its 0.001 s limit (TANDEM_RETRIEVAL_OCR_PAGE_TIMEOUT_S)"
    assert job["result"]["pages_without_text"] == {"mixed.pdf": [2]}
    assert job["result"]["pages without text"] == {"mixed.pdf": [2]}
    assert job["result"]["page_errors"] == {"mixed.pdf": {"2": reason}}
    [blank] = job["file_errors"]
    assert blank["filename"] == "blank.png" and blank["code"] == "empty_file"
    assert blank["pages_without_text"] == blank["pages without text"] == [1]
    assert f"page 1: {reason}" in blank["message"]
    assert search(client, query="barn owls nest", mode="sparse", top_k=1)[0]["document_id"] == "mixed.pdf"


def test_a_file_without_any_text_fails_the_job_naming_it_and_its_pages(client: httpx.Client) -> None:
    make(client)
    blank = Image.new("L", (300, 200), 255)
    r = client.post("/v1/collections/kb/files", files=[("file", ("blank.pdf", scanned_pdf([blank, blank])))])
    job = run_queued_job(client, r)
    assert job["status"] == "failed"
    assert "'blank.pdf' contains no extractable text (pages without text: 1-2)" in job["error"]
    assert job["file_errors"][0]["pages_without_text"] == [1, 2]


def test_the_ocr_language_is_a_collection_setting(client: httpx.Client) -> None:
    assert make(client)["ocr_language"] == "en"
    assert make(client, "zh-docs", ocr_language="zh")["ocr_language"] == "zh"
    bad = client.post("/v1/collections", json={"name": "fr-docs", "ocr_language": "fr"})
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["param"] == "ocr_language" and "'fr'" in err["message"]
    assert "'en' (English)" in err["message"] and "'zh'" in err["message"]
    assert client.get("/v1/collections/fr-docs").status_code == 404
    assert client.post("/v1/collections", json={"name": "n", "ocr_language": 7}).status_code == 400
    assert client.post("/v1/collections", json={"name": "n", "ocr_language": "x" * 17}).status_code == 400

    changed = client.patch("/v1/collections/kb", json={"ocr_language": "zh"})
    assert changed.status_code == 200 and changed.json()["ocr_language"] == "zh"
    assert client.get("/v1/collections/kb").json()["ocr_language"] == "zh"
    refused = client.patch("/v1/collections/kb", json={"ocr_language": "de"})
    assert refused.status_code == 400 and "'de'" in refused.text
    assert client.get("/v1/collections/kb").json()["ocr_language"] == "zh"
    assert client.patch("/v1/collections/kb", json={}).status_code == 400


def test_pdf_pages_are_read_with_boxes_in_points() -> None:
    img, boxes = page_image([(20, 20, LEFT[0]), (20, 70, LEFT[1])], (500, 130))
    data = scanned_pdf([img])  # 100 dpi: 360 x 93.6 points
    [page] = ocr_pdf_pages(data, [1], OcrSettings())
    assert (page.page, page.width, page.height) == (1, 360.0, 93.6)
    assert len(page.lines) == 2 and all(same(ln.text, t) for ln, t in zip(page.lines, LEFT[:2], strict=True))
    points = tuple(v * 72 / 100 for v in boxes[1])
    assert overlap(page.lines[1].box, points) > 0.5  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["embedded", "milvus"])
def test_the_ocr_language_is_stored_by_each_backend(
    backend: str, tmp_path: Path, tiny_embedder: Path, request: pytest.FixtureRequest
) -> None:
    from services.retrieval.config import RetrievalSettings
    from services.retrieval.core.registry import CollectionManager
    from services.retrieval.ingest import ocr_of

    settings = RetrievalSettings(embedding_model=str(tiny_embedder), ocr_dpi=150)
    if backend == "milvus":
        settings = settings.model_copy(
            update={"backend": "milvus", "milvus_uri": request.getfixturevalue("milvus_uri")}
        )
    m = CollectionManager(tmp_path, settings, [tiny_embedder.parent])
    try:
        m.create("t-ocr", "scans", ocr_language="zh")
        assert m.get("t-ocr", "scans").config.ocr_language == "zh"
        m.set_ocr_language("t-ocr", "scans", "en")
        assert m.get("t-ocr", "scans").config.ocr_language == "en"  # the open collection too
        m.close_all()
        fresh = CollectionManager(tmp_path, settings, [tiny_embedder.parent])
        assert fresh.config("t-ocr", "scans").ocr_language == "en"
        assert ocr_of(fresh, "en") == OcrSettings(
            language="en", page_timeout_s=60.0, max_pixels=40_000_000, dpi=150
        )
        fresh.delete("t-ocr", "scans")
        fresh.close_all()
    finally:
        m.close_all()


def test_each_page_ocr_begins_gives_the_file_more_time() -> None:
    """The worker's whole-file limit grows by the page limit for each page the child begins to
    read, so a long scan is read; a child that outruns that is still killed. (A child that
    reads four pages in 4 x 0.75 s = 3 s, against a file limit of 2 s.)"""
    from services.retrieval.core.sandbox import TooLong, run_parser

    request: dict[str, object] = {"pages": 4, "page_s": 0.75}
    status, _ = run_parser(request, 2.0, 5.0, 512 * 1024 * 1024, module="tests.helpers.pages_child")
    assert status == 0  # 2 s + 4 x 5 s granted
    with pytest.raises(TooLong) as caught:
        run_parser(request, 2.0, 0.0, 512 * 1024 * 1024, module="tests.helpers.pages_child")
    assert caught.value.pages >= 1  # killed at 2 s, pages begun and all
