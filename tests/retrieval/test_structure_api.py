"""Chunk structure over the REST API: search hits carry pages, section paths and anchors; a
PDF's original file is served to its tenant only; stores of before the structure column open."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import httpx

from services.agent.chunks import Chunk
from services.agent.citations import CitationTracker
from services.retrieval.config import RetrievalSettings
from services.retrieval.core.parsing import parse_file
from services.retrieval.core.registry import CollectionManager
from services.retrieval.core.store import SQLiteDocumentStore
from tests.helpers.documents import SOLAR_TITLE, solar_pdf
from tests.retrieval.conftest import run_queued_job
from tests.retrieval.test_api import make, search
from tests.retrieval.test_structure_parsing import HTML, MARKDOWN


def test_hits_and_documents_carry_structure(client: httpx.Client, other_client: httpx.Client) -> None:
    make(client, chunking={"size": 24, "overlap": 0})
    pdf = solar_pdf()
    r = client.post(
        "/v1/collections/kb/files",
        files=[
            ("file", ("solar.pdf", pdf)),
            ("file", ("ops.html", HTML)),
            ("file", ("handbook.md", MARKDOWN)),
        ],
    )
    job = run_queued_job(client, r)
    assert job["status"] == "succeeded" and job["file_errors"] == [], job

    hit = search(client, query="Titan moon", mode="sparse", top_k=1)[0]
    assert hit["document_id"] == "solar.pdf" and "Titan" in hit["text"]
    assert hit["pages"] == [3] and hit["page_starts"] == [hit["start"]]
    assert hit["section"] == f"{SOLAR_TITLE} > Saturn" and hit["headings"] == [SOLAR_TITLE, "Saturn"]
    red = search(client, query="Great Red Spot storm", mode="sparse", top_k=1)[0]
    assert red["pages"] == [2]
    # the agent's citation of a hit, as its pipelines make it: the cited sentence and its page
    tracker = CitationTracker([Chunk.from_result(hit), Chunk.from_result(red)])
    tracker.feed("Titan is the largest moon [1]. The spot is a storm [2].")
    tracker.finish()
    titan, spot = tracker.citations
    pdf_text = client.get("/v1/collections/kb/documents/solar.pdf").json()["text"]
    assert titan.span is not None and titan.span.text == "Titan is the largest moon of Saturn."
    assert pdf_text[titan.span.start : titan.span.end] == titan.span.text
    assert (titan.page, titan.section) == (3, f"{SOLAR_TITLE} > Saturn")
    assert spot.page == 2 and spot.span is not None and "Great Red Spot" in spot.span.text

    html = search(client, query="roll back command", mode="sparse", top_k=1)[0]
    assert html["document_id"] == "ops.html"
    assert html["section"] == "Operations > Rollback" and html["anchor"] == "rollback" and html["pages"] == []
    md = search(client, query="postgres valkey port", mode="sparse", top_k=1)[0]
    assert md["section"] == "Handbook > Setup > Database" and "| valkey | 6379 |" in md["text"]
    doc = client.get("/v1/collections/kb/documents/handbook.md").json()
    assert doc["text"][md["section_start"] : md["section_end"]].startswith("### Database")
    assert "section_text" not in md or md["section_text"] is None  # only when asked for
    # small chunks ranked, the enclosing section returned (within a budget of model tokens)
    (wide,) = search(client, query="postgres valkey port", mode="sparse", top_k=1, section_tokens=400)
    assert wide["chunk_id"] == md["chunk_id"]
    start = wide["section_text_start"]
    assert doc["text"][start : start + len(wide["section_text"])] == wide["section_text"]
    assert md["text"] in wide["section_text"] and "Done with the database." in wide["section_text"]
    bad = client.post("/v1/collections/kb/search", json={"query": "x", "section_tokens": 3})
    assert bad.status_code in (400, 422) and "section_tokens" in bad.text
    spans = client.get("/v1/collections/kb/documents/solar.pdf").json()["chunk_list"]
    assert {p for s in spans for p in s["pages"]} == {1, 2, 3}

    # The original PDF: the tenant's own, with its key; no other tenant sees it.
    got = client.get("/v1/collections/kb/originals/solar.pdf")
    assert got.status_code == 200 and got.headers["content-type"] == "application/pdf"
    assert got.content == pdf
    base = str(client.base_url).rstrip("/")
    assert httpx.get(f"{base}/v1/collections/kb/originals/solar.pdf").status_code == 401
    assert other_client.get("/v1/collections/kb/originals/solar.pdf").status_code == 404
    missing = client.get("/v1/collections/kb/originals/ops.html")
    assert missing.status_code == 404 and "ops.html" in missing.json()["error"]["message"]
    assert client.delete("/v1/collections/kb/documents/solar.pdf").status_code == 204
    assert client.get("/v1/collections/kb/originals/solar.pdf").status_code == 404


OLD_CHUNKS = """CREATE TABLE chunks (
    vid INTEGER PRIMARY KEY AUTOINCREMENT, chunk_id TEXT NOT NULL UNIQUE, doc_id TEXT NOT NULL,
    ord INTEGER NOT NULL, start INTEGER NOT NULL, "end" INTEGER NOT NULL, text TEXT NOT NULL,
    context TEXT NOT NULL DEFAULT '', embedding BLOB NOT NULL)"""


def test_a_store_without_the_structure_column_opens(tmp_path: Path) -> None:
    db = tmp_path / "store.sqlite"
    conn = sqlite3.connect(db)
    conn.execute(OLD_CHUNKS)
    conn.execute(
        "INSERT INTO chunks(chunk_id, doc_id, ord, start, \"end\", text, embedding) VALUES ('c', 'd', 0, 0, 2, 'hi', x'00000000')"
    )
    conn.commit()
    conn.close()
    store = SQLiteDocumentStore(db)
    try:
        conn = sqlite3.connect(db)
        assert conn.execute("SELECT structure FROM chunks").fetchall() == [("{}",)]
        conn.close()
    finally:
        store.close()


def test_milvus_stores_chunk_structure(tmp_path: Path, tiny_embedder: Path, milvus_uri: str) -> None:
    settings = RetrievalSettings(embedding_model=str(tiny_embedder), backend="milvus", milvus_uri=milvus_uri)
    m = CollectionManager(tmp_path, settings, [tiny_embedder.parent])
    try:
        m.create("t-structure", "notes")
        col = m.get("t-structure", "notes")
        doc = parse_file("solar.pdf", solar_pdf())[0]
        col.ingest([doc])
        hit = col.search("Titan moon Saturn", mode="sparse", top_k=1)[0]
        assert hit.pages == [3] and hit.section == f"{SOLAR_TITLE} > Saturn"
        stored = col.get_document("solar.pdf")
        assert stored is not None and stored.chunk_list
        assert {p for c in stored.chunk_list for p in c.pages} == {1, 2, 3}
        m.delete("t-structure", "notes")
    finally:
        m.close_all()
