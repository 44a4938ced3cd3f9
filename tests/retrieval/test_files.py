"""File uploads: each format made in the test and parsed by the real library; bad files are
clear 4xx errors naming the file and the problem."""

from __future__ import annotations

import io
import json

import httpx
import pytest

from tests.retrieval.conftest import run_queued_job
from tests.retrieval.test_api import make, search


def make_pdf(text_lines: list[str]) -> bytes:
    from reportlab.lib.pagesizes import letter
    from reportlab.pdfgen import canvas

    buf = io.BytesIO()
    c = canvas.Canvas(buf, pagesize=letter)
    y = 720
    for line in text_lines:
        c.drawString(72, y, line)
        y -= 18
    c.showPage()
    c.drawString(72, 720, "Second page mentions photosynthesis in chloroplasts.")
    c.save()
    return buf.getvalue()


def make_docx() -> bytes:
    from docx import Document

    doc = Document()
    doc.core_properties.title = "Field Guide"
    doc.add_heading("Owls", level=1)
    doc.add_paragraph("Owls hunt at night using silent flight feathers.")
    doc.add_heading("Diet", level=2)
    doc.add_paragraph("They swallow voles whole and regurgitate pellets.")
    buf = io.BytesIO()
    doc.save(buf)
    return buf.getvalue()


HTML = b"""<html><head><title>Volcano notes</title><style>body{color:red}</style>
<script>var secret = "do-not-index";</script></head>
<body><h1>Volcanoes</h1><p>Magma rises through the <b>crust</b>.</p>
<h2>Eruptions</h2><p>Pyroclastic flows move fast.</p></body></html>"""

MARKDOWN = b"""# Glaciers

Glaciers carve **U-shaped** valleys over millennia.

## Moraines

Moraines are ridges of [debris](http://example.com) left behind.
"""


def upload(client: httpx.Client, name: str, data: bytes, *, metadata: dict | None = None) -> httpx.Response:
    form = {"metadata": json.dumps(metadata)} if metadata else None
    return client.post("/v1/collections/kb/files", files={"file": (name, data)}, data=form)


def test_each_format_is_parsed_and_searchable(client: httpx.Client) -> None:
    make(client)
    cases = [
        ("notes.txt", b"Tardigrades survive the vacuum of space.\n", "tardigrades vacuum", "Tardigrades"),
        ("glaciers.md", MARKDOWN, "moraines debris ridges", "Moraines are ridges"),
        ("volcano.html", HTML, "pyroclastic flows", "Pyroclastic flows move fast."),
        (
            "paper.pdf",
            make_pdf(["Mitochondria produce ATP for the cell."]),
            "mitochondria ATP",
            "Mitochondria",
        ),
        ("guide.docx", make_docx(), "owls silent flight", "silent flight"),
    ]
    for name, data, query, expect in cases:
        r = upload(client, name, data, metadata={"kind": name.rsplit(".", 1)[1]})
        assert r.json()["document_ids"] == [name]
        if name.endswith((".html", ".pdf", ".docx")):
            # parsed by the ingestion worker, never in the API process
            job = run_queued_job(client, r)
            assert job["state"] == "succeeded" and job["file_errors"] == [], job
        else:
            assert r.status_code == 201, (name, r.text)
        hits = search(client, query=query, mode="sparse", top_k=3)
        assert hits and hits[0]["document_id"] == name, (name, hits)
        assert expect in hits[0]["text"]
        assert hits[0]["metadata"] == {"source": name, "kind": name.rsplit(".", 1)[1]}
    md = client.get("/v1/collections/kb/documents/glaciers.md").json()
    assert "# Glaciers" in md["text"] and "## Moraines" in md["text"] and "**" not in md["text"]
    html = client.get("/v1/collections/kb/documents/volcano.html").json()
    assert (
        html["title"] == "Volcano notes"
        and "# Volcanoes" in html["text"]
        and "do-not-index" not in html["text"]
    )
    docx = client.get("/v1/collections/kb/documents/guide.docx").json()
    assert "# Owls" in docx["text"] and "## Diet" in docx["text"] and docx["title"] == "Field Guide"
    pdf = client.get("/v1/collections/kb/documents/paper.pdf").json()
    assert "photosynthesis" in pdf["text"]  # both pages
    # Markdown headings become sections: the moraine chunk does not include the glacier paragraph
    hit = search(client, query="moraines", mode="sparse", filters={"kind": "md"}, top_k=5)
    assert all("U-shaped" not in h["text"] for h in hit if "Moraines are" in h["text"])


def test_jsonl_upload_makes_one_document_per_line(client: httpx.Client) -> None:
    make(client)
    lines = [
        {"id": "a", "text": "Alpha particles are helium nuclei.", "metadata": {"n": 1}},
        {"_id": "b", "title": "Beta", "text": "Beta decay emits electrons."},
    ]
    data = "\n".join(json.dumps(x) for x in lines).encode()
    r = upload(client, "set.jsonl", data)
    assert r.status_code == 201, r.text
    assert r.json()["document_ids"] == ["a", "b"]
    assert client.get("/v1/collections/kb/documents/b").json()["title"] == "Beta"
    assert search(client, query="electrons decay", mode="sparse")[0]["document_id"] == "b"


def test_reupload_replaces(client: httpx.Client) -> None:
    make(client)
    assert upload(client, "n.txt", b"Old content about comets.").status_code == 201
    r = upload(client, "n.txt", b"New content about asteroids.")
    assert r.json()["chunks_removed"] == 1 and r.json()["chunks_added"] == 1
    assert search(client, query="comets", mode="sparse") == []
    assert client.get("/v1/collections/kb").json()["documents"] == 1


@pytest.mark.parametrize(
    ("name", "data", "status", "needles"),
    [
        ("empty.txt", b"", 400, ["empty.txt", "empty"]),
        ("blank.md", b"   \n\n", 400, ["blank.md", "no extractable text"]),
        ("image.gif", b"GIF89a", 415, ["image.gif", "unsupported type .gif"]),
        ("noext", b"hello", 415, ["noext", "unsupported type"]),
        ("latin1.txt", "caf\u00e9".encode("latin-1"), 400, ["latin1.txt", "not valid UTF-8", "0xe9"]),
        ("bad.jsonl", b'{"id": "a", "text": "ok"}\n{broken\n', 400, ["bad.jsonl", "line 2"]),
        ("noid.jsonl", b'{"text": "no id"}\n', 400, ["noid.jsonl", "missing 'id'"]),
    ],
)
def test_bad_files(client: httpx.Client, name: str, data: bytes, status: int, needles: list[str]) -> None:
    make(client)
    r = upload(client, name, data)
    assert r.status_code == status, r.text
    msg = r.json()["error"]["message"]
    for n in needles:
        assert n in msg, msg
    assert client.get("/v1/collections/kb").json()["documents"] == 0


def _docx_with(document_xml: bytes, *, level: int = 9) -> bytes:
    """A DOCX (made by python-docx) whose word/document.xml is replaced by ``document_xml``."""
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(make_docx())) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.infolist():
            data = document_xml if item.filename == "word/document.xml" else src.read(item.filename)
            dst.writestr(item.filename, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=level)
    return out.getvalue()


@pytest.mark.parametrize(
    ("name", "data", "needles"),
    [
        ("broken.pdf", b"%PDF-1.4\n1 0 obj garbage\n%%EOF", ["broken.pdf", "not a readable PDF"]),
        ("fake.docx", b"PK\x03\x04 not really a zip", ["fake.docx", "not a readable DOCX"]),
        # malformed XML inside a valid zip: was a 500 in the API process
        ("badxml.docx", _docx_with(b"<w:document><unclosed>"), ["badxml.docx", "not a readable DOCX"]),
        # a small file that inflates far beyond its size: refused from the zip directory
        (
            "bomb.docx",
            _docx_with(b"<?xml version='1.0'?><w:document" + b" " * (40 * 1024 * 1024) + b"/>"),
            ["bomb.docx", "compression ratio", "TANDEM_RETRIEVAL_PARSE_MAX_RATIO"],
        ),
    ],
)
def test_hostile_files_are_per_file_job_errors(
    client: httpx.Client, name: str, data: bytes, needles: list[str]
) -> None:
    make(client)
    good = ("fine.txt", b"Otters hold hands while sleeping.")
    r = client.post("/v1/collections/kb/files", files=[("file", (name, data)), ("file", good)])
    assert r.status_code == 202, r.text
    job = run_queued_job(client, r)
    assert job["state"] == "succeeded", job
    [err] = job["file_errors"]
    assert err["filename"] == name
    for n in needles:
        assert n in err["message"], err
    # the good file of the same upload was ingested
    assert client.get("/v1/collections/kb").json()["documents"] == 1
    # alone, the bad file fails the job with the same message
    r = upload(client, name, data)
    job = run_queued_job(client, r)
    assert job["state"] == "failed" and needles[-1] in job["error"], job


def test_parse_limits_pages_and_decompressed_size(
    client: httpx.Client, retrieval_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.retrieval.app import create_app
    from tests.helpers.servers import serve_app
    from tests.retrieval.conftest import SERVED

    make(client)
    monkeypatch.setenv("TANDEM_RETRIEVAL_PARSE_MAX_PAGES", "1")
    monkeypatch.setenv("TANDEM_RETRIEVAL_PARSE_MAX_DECOMPRESSED_MB", "1")
    app = create_app()
    with serve_app(app) as url, httpx.Client(base_url=url, headers=dict(client.headers), timeout=60) as c:
        SERVED[url] = app
        r = c.post("/v1/collections/kb/files", files={"file": ("two.pdf", make_pdf(["one page", "x"]))})
        job = run_queued_job(c, r)
        assert job["state"] == "failed" and "2 pages, more than 1" in job["error"], job
        assert "TANDEM_RETRIEVAL_PARSE_MAX_PAGES" in job["error"]
        big = _docx_with(
            b"<?xml version='1.0'?><w:document>" + b"<w:p/>" * 400_000 + b"</w:document>", level=1
        )
        r = c.post("/v1/collections/kb/files", files={"file": ("big.docx", big)})
        job = run_queued_job(c, r)
        assert job["state"] == "failed" and "more than 1 MiB" in job["error"], job


def test_oversized_upload(client: httpx.Client, retrieval_env, monkeypatch: pytest.MonkeyPatch) -> None:
    make(client)
    big = b"word " * (2 * 1024 * 1024 // 5 + 10)  # just over 2 MiB
    # The service was started with the default limit: use a dedicated app with a 1 MiB limit.
    from services.retrieval.app import create_app
    from tests.helpers.servers import serve_app

    monkeypatch.setenv("TANDEM_RETRIEVAL_MAX_UPLOAD_MB", "1")
    with serve_app(create_app()) as url:
        r = httpx.post(
            f"{url}/v1/collections/kb/files",
            files={"file": ("big.txt", big)},
            headers=dict(client.headers),
            timeout=60,
        )
    assert r.status_code == 413, r.text
    assert "1 MiB" in r.json()["error"]["message"]


def test_unsafe_filename_is_cleaned(client: httpx.Client) -> None:
    make(client)
    r = upload(client, "../../etc/passwd.txt", b"root:x:0:0")
    assert r.status_code == 201, r.text
    assert r.json()["document_ids"] == ["passwd.txt"]


def test_upload_to_unknown_collection(client: httpx.Client) -> None:
    r = client.post("/v1/collections/missing/files", files={"file": ("a.txt", b"x")})
    assert r.status_code == 404 and "missing" in r.json()["error"]["message"]
