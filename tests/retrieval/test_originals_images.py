"""Originals a viewer can draw: a PNG or JPEG as it was uploaded, a TIFF page by page as PNG
(converted in a child process with limits, kept beside the original until the document goes),
and a clear 4xx for a page that is not there or a file that cannot be read."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
from PIL import Image

from services.retrieval.core.originals import find_original, keep_original, rendition_path
from tests.retrieval.conftest import SERVED
from tests.retrieval.test_api import ingest, make


def frames(*colors: tuple[int, int, int], size: tuple[int, int] = (120, 80)) -> bytes:
    """A TIFF with one page per colour."""
    pages = [Image.new("RGB", size, c) for c in colors]
    out = io.BytesIO()
    pages[0].save(out, format="TIFF", save_all=True, append_images=pages[1:], compression="tiff_deflate")
    return out.getvalue()


def keep(client: httpx.Client, tmp_path: Path, doc_id: str, data: bytes, ext: str) -> Path:
    """``data`` kept as the original of the document ``doc_id`` of collection kb, as the
    ingestion worker keeps an uploaded file's."""
    ingest(client, [{"id": doc_id, "text": f"The text read from {doc_id}."}])
    src = tmp_path / f"upload{ext}"
    src.write_bytes(data)
    col = SERVED[str(client.base_url).rstrip("/")].state.collections.get("acme", "kb")  # type: ignore[attr-defined]
    keep_original(col.root, doc_id, src, ext)
    found = find_original(col.root, doc_id)
    assert found is not None and found.suffix == ext
    return found


def test_a_tiff_is_served_page_by_page_as_png(client: httpx.Client, tmp_path: Path) -> None:
    make(client)
    kept = keep(client, tmp_path, "scan.tiff", frames((255, 0, 0), (0, 0, 255)), ".tiff")
    second = client.get("/v1/collections/kb/originals/scan.tiff", params={"page": 2})
    assert second.status_code == 200 and second.headers["content-type"] == "image/png"
    img = Image.open(io.BytesIO(second.content))
    assert img.format == "PNG" and img.size == (120, 80) and img.getpixel((5, 5)) == (0, 0, 255)
    first = client.get("/v1/collections/kb/originals/scan.tiff")  # page 1 by default
    assert Image.open(io.BytesIO(first.content)).getpixel((5, 5)) == (255, 0, 0)
    assert rendition_path(kept, 2).is_file()  # made once, served from there afterwards

    missing = client.get("/v1/collections/kb/originals/scan.tiff", params={"page": 3})
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "page" and "no page 3" in missing.json()["error"]["message"]
    zero = client.get("/v1/collections/kb/originals/scan.tiff", params={"page": 0})
    assert zero.status_code == 400 and "page" in zero.text

    # the document goes, and its original and the pages made of it with it
    assert client.delete("/v1/collections/kb/documents/scan.tiff").status_code == 204
    assert not kept.exists() and not rendition_path(kept, 2).exists()
    assert client.get("/v1/collections/kb/originals/scan.tiff").status_code == 404


def test_png_and_jpeg_are_served_as_uploaded(client: httpx.Client, tmp_path: Path) -> None:
    make(client)
    for name, fmt, ext, media in (
        ("page.png", "PNG", ".png", "image/png"),
        ("photo.jpg", "JPEG", ".jpg", "image/jpeg"),
    ):
        out = io.BytesIO()
        Image.new("RGB", (40, 30), (0, 128, 0)).save(out, format=fmt)
        keep(client, tmp_path, name, out.getvalue(), ext)
        got = client.get(f"/v1/collections/kb/originals/{name}", params={"page": 1})
        assert got.status_code == 200 and got.headers["content-type"] == media
        assert got.content == out.getvalue()


def test_a_corrupt_tiff_is_a_400_naming_the_document(client: httpx.Client, tmp_path: Path) -> None:
    make(client)
    keep(client, tmp_path, "bad.tif", b"II*\x00" + b"\x00" * 64, ".tif")
    bad = client.get("/v1/collections/kb/originals/bad.tif")
    assert bad.status_code == 400, bad.text
    assert "'bad.tif'" in bad.json()["error"]["message"] and bad.json()["error"]["param"] == "page"


def test_a_new_original_replaces_one_of_another_type(client: httpx.Client, tmp_path: Path) -> None:
    make(client)
    old = keep(client, tmp_path, "scan", frames((1, 2, 3)), ".tiff")
    client.get("/v1/collections/kb/originals/scan")  # its page 1 made as PNG
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, format="PNG")
    new = keep(client, tmp_path, "scan", out.getvalue(), ".png")
    assert not old.exists() and not rendition_path(old, 1).exists() and new.is_file()
    assert client.get("/v1/collections/kb/originals/scan").headers["content-type"] == "image/png"


def test_an_uploaded_tiff_keeps_its_pages_and_its_hits_their_boxes(client: httpx.Client) -> None:
    """Through the upload job: the TIFF's pages are read by OCR, the file is kept as the original
    and served page by page, and a hit's citation carries the boxes of its lines on that page."""
    from services.agent.chunks import Chunk, Citation
    from tests.retrieval.conftest import run_queued_job
    from tests.retrieval.test_api import search
    from tests.retrieval.test_ocr import page_image

    make(client)
    first, _ = page_image([(30, 30, "Barn owls hunt at night over fields.")], (700, 100))
    second, drawn = page_image([(30, 30, "Tawny owls keep to the woods all year.")], (700, 100))
    out = io.BytesIO()
    first.save(out, format="TIFF", save_all=True, append_images=[second])
    job = run_queued_job(
        client, client.post("/v1/collections/kb/files", files=[("file", ("owls.tiff", out.getvalue()))])
    )
    assert job["status"] == "succeeded", job

    page2 = client.get("/v1/collections/kb/originals/owls.tiff", params={"page": 2})
    assert page2.status_code == 200 and page2.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(page2.content)).size == (700, 100)

    hit = search(client, query="tawny owls woods", mode="sparse", top_k=1)[0]
    cite = Citation.of(1, Chunk.from_result(hit), claim="Tawny owls stay in the woods [1].")
    # one chunk holds both pages' lines: their boxes, and the size of each page
    assert cite.page == 2 and cite.span is not None and cite.boxes
    assert cite.page_sizes == [[1.0, 700.0, 100.0], [2.0, 700.0, 100.0]]
    rel = (cite.span.start - cite.start, cite.span.end - cite.start)
    (box,) = [b for b in cite.boxes if b[0] < rel[1] and b[1] > rel[0]]
    # the OCR'd line's box, in the image's pixels, where the line was drawn
    assert box[2] == 2
    assert abs(box[3] - drawn[0][0]) < 8 and abs(box[4] - drawn[0][1]) < 8 and abs(box[6] - drawn[0][3]) < 8
