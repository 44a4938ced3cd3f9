"""Conformance: every retrieval backend (embedded SQLite + FAISS + BM25, and Milvus on a
Milvus Lite server) and every ``ChunkStore`` pass the same checks: ingestion, replacement,
deletion, paging, each search mode, metadata filters with the same answers, and reranking."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from services.retrieval.config import RetrievalSettings
from services.retrieval.core.chunking import chunk_id
from services.retrieval.core.collection import InputDocument
from services.retrieval.core.registry import CollectionManager
from services.retrieval.core.store import (
    ChunkRecord,
    ChunkStore,
    DocumentRecord,
    MissingEmbeddings,
    SQLiteDocumentStore,
)

BACKENDS = ["embedded", "milvus"]

DOCS = [
    InputDocument(
        "cats",
        "Cats purr and chase mice around the barn.",
        "Cats",
        {"lang": "en", "year": 2019, "tag": "pet"},
    ),
    InputDocument(
        "dogs", "Dogs bark loudly at the mailman every morning.", "Dogs", {"lang": "en", "year": 2021}
    ),
    InputDocument(
        "birds", "Birds migrate south when winter comes.", "", {"lang": "fr", "year": 2023, "tag": "wild"}
    ),
    InputDocument("hund", "Der Hund bellt den Briefträger an.", "Hund", {"lang": "de", "year": 2020.5}),
    InputDocument("plain", "A note about barns and mice with no metadata.", "", {}),
]


def manager_for(backend: str, home: Path, tiny: Path, milvus_uri: str, **kw: object) -> CollectionManager:
    settings = RetrievalSettings(
        embedding_model=str(tiny),
        backend=backend,
        milvus_uri=milvus_uri,
        **kw,  # type: ignore[arg-type]
    )
    return CollectionManager(home, settings, [tiny.parent])


@pytest.fixture(params=BACKENDS)
def manager(
    request: pytest.FixtureRequest, tmp_path: Path, tiny_embedder: Path
) -> Iterator[CollectionManager]:
    uri = request.getfixturevalue("milvus_uri") if request.param == "milvus" else "http://unused:1"
    m = manager_for(request.param, tmp_path, tiny_embedder, uri)
    yield m
    m.close_all()


@pytest.fixture()
def tenant() -> str:
    return f"t{uuid.uuid4().hex[:8]}"  # the Milvus server is shared by the session's tests


def test_ingest_search_replace_delete(manager: CollectionManager, tenant: str) -> None:
    manager.create(tenant, "c")
    col = manager.get(tenant, "c")
    res = col.ingest(DOCS)
    assert res.documents == 5 and res.chunks_added == 5 and res.chunks_removed == 0
    assert col.ingest(DOCS[:1]).chunks_unchanged == 1  # same text: nothing re-embedded
    for mode in ("dense", "sparse", "hybrid"):
        hits = col.search("mailman bark", mode=mode, top_k=3)
        assert hits and 1 <= len(hits) <= 3, mode
        h = next(h for h in hits if h.document_id == "dogs")
        assert (
            h.text == DOCS[1].text[h.start : h.end] and h.metadata == DOCS[1].metadata and h.title == "Dogs"
        )
        assert mode in h.scores
    assert col.search("mailman bark", mode="sparse")[0].document_id == "dogs"
    assert col.search("the of and", mode="sparse") == []  # stopwords only: nothing to match
    assert col.search("zyxwvut", mode="sparse") == []  # a word no document has
    # replacement: the old text is gone from every index
    res = col.ingest([InputDocument("dogs", "Dogs sleep on the sofa all afternoon.", "Dogs", {"lang": "en"})])
    assert (res.chunks_added, res.chunks_removed) == (1, 1)
    assert all(h.document_id != "dogs" for h in col.search("mailman", mode="sparse"))
    assert col.search("sofa afternoon", mode="sparse")[0].document_id == "dogs"
    doc = col.get_document("dogs")
    assert (
        doc is not None
        and doc.text == "Dogs sleep on the sofa all afternoon."
        and doc.metadata == {"lang": "en"}
    )
    assert doc.chunk_list and doc.text[doc.chunk_list[0].start : doc.chunk_list[0].end]
    page, total = col.list_documents(2, 1)
    assert total == 5 and [d.id for d in page] == ["cats", "dogs"] and page[0].text is None
    assert col.stats()["documents"] == 5 and col.stats()["chunks"] == 5
    assert col.delete_document("cats") and not col.delete_document("cats")
    assert col.get_document("cats") is None
    assert all(h.document_id != "cats" for h in col.search("purr mice", top_k=10))
    assert [c.name for c in manager.list(tenant)] == ["c"]
    manager.delete(tenant, "c")
    assert manager.list(tenant) == []


def test_long_document_round_trips(manager: CollectionManager, tenant: str) -> None:
    """Text longer than a Milvus string (64 KiB) is stored in parts and read back whole."""
    manager.create(tenant, "long", chunk_size=512, chunk_overlap=0)
    col = manager.get(tenant, "long")
    text = " ".join(f"wörd{i}" for i in range(15000))  # ~120 KB, non-ASCII
    col.ingest([InputDocument("big", text, "", {})])
    doc = col.get_document("big")
    assert doc is not None and doc.text == text
    assert doc.chunk_list and all(doc.text[c.start : c.end] for c in doc.chunk_list)
    assert col.search("wörd14999", mode="sparse")[0].document_id == "big"
    assert {c.context for c in doc.chunk_list} == {""}  # no title, no headings


def test_a_documents_chunks_carry_the_context_indexed_with_them(
    manager: CollectionManager, tenant: str
) -> None:
    """Each chunk of ``get_document`` names the title and headings indexed with its text, so a
    reader (an embedder job mapping its pairs to chunks) rebuilds exactly what was embedded."""
    manager.create(tenant, "ctx", chunk_size=64, chunk_overlap=0)
    col = manager.get(tenant, "ctx")
    text = "# Setup\nInstall the package with pip first.\n# Use\nRun the command and read its output."
    col.ingest([InputDocument("guide", text, "Guide", {})])
    doc = col.get_document("guide")
    assert doc is not None and doc.chunk_list and len(doc.chunk_list) >= 2
    contexts = [c.context for c in doc.chunk_list]
    assert all(c.startswith("Guide") for c in contexts) and contexts[-1] == "Guide > Use", contexts
    hit = col.search("read its output", mode="sparse")[0]
    last = doc.chunk_list[-1]
    assert hit.chunk_id == last.chunk_id and hit.text == doc.text[last.start : last.end]


FILTERS: list[tuple[dict, set[str]]] = [
    ({"lang": "en"}, {"cats", "dogs"}),
    ({"lang": {"$ne": "en"}}, {"birds", "hund"}),  # "plain" has no lang: unknown, not a match
    ({"$not": {"lang": "en"}}, {"birds", "hund"}),
    ({"lang": {"$in": ["fr", "de"]}}, {"birds", "hund"}),
    ({"lang": {"$nin": ["fr", "de"]}}, {"cats", "dogs"}),
    ({"year": {"$gte": 2020, "$lt": 2023}}, {"dogs", "hund"}),
    ({"year": {"$gt": 2020.5}}, {"dogs", "birds"}),
    ({"$or": [{"tag": "pet"}, {"year": {"$lte": 2020}}]}, {"cats"}),
    ({"$or": [{"tag": "wild"}, {"lang": "de"}], "year": {"$gt": 2020}}, {"birds", "hund"}),
    ({"$not": {"$or": [{"lang": "en"}, {"year": {"$gt": 2022}}]}}, {"hund"}),
    ({"$and": [{"lang": "en"}, {"$not": {"tag": "pet"}}]}, set()),  # dogs has no tag: unknown
    ({"tag": {"$nin": ["pet"]}}, {"birds"}),
]


@pytest.mark.parametrize(("where", "expected"), FILTERS, ids=[str(f) for f, _ in FILTERS])
def test_filters_agree(manager: CollectionManager, tenant: str, where: dict, expected: set[str]) -> None:
    manager.create(tenant, "f")
    col = manager.get(tenant, "f")
    col.ingest(DOCS)
    for mode in ("dense", "sparse", "hybrid"):
        query = "mice barn bark winter Hund" if mode == "sparse" else "animals"
        got = {h.document_id for h in col.search(query, mode=mode, top_k=20, filters=where)}
        # sparse finds only documents sharing a word with the query; all five here do
        assert got == expected, (mode, where)


def test_weighted_hybrid_follows_the_weights(manager: CollectionManager, tenant: str) -> None:
    manager.create(tenant, "w")
    col = manager.get(tenant, "w")
    col.ingest(DOCS)
    sparse = [h.document_id for h in col.search("mice barn", mode="sparse", top_k=5)]
    only_sparse = col.search("mice barn", mode="hybrid", top_k=5, weights={"dense": 0.0, "sparse": 1.0})
    assert [h.document_id for h in only_sparse] == sparse
    both = col.search("mice barn", mode="hybrid", top_k=5)
    assert all("hybrid" in h.scores for h in both)
    assert [h.score for h in both] == sorted((h.score for h in both), reverse=True)


# -- ChunkStore ------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "milvus"])
def chunk_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ChunkStore]:
    if request.param == "sqlite":
        store: ChunkStore = SQLiteDocumentStore(tmp_path / "s.sqlite3")
    else:
        from pymilvus import MilvusClient

        from services.retrieval.milvus.store import MilvusChunkStore, create_collections, drop_collections

        client = MilvusClient(request.getfixturevalue("milvus_uri"))
        prefix = f"conf_{uuid.uuid4().hex[:12]}"
        create_collections(client, prefix, 4, "english", "flat", 1.2, 0.75)
        store = MilvusChunkStore(client, prefix)
    yield store
    store.close()
    if request.param == "milvus":
        drop_collections(client, prefix)
        client.close()


def _doc(doc_id: str, texts: list[str], meta: dict | None = None, title: str = "t") -> DocumentRecord:
    chunks, pos = [], 0
    for i, t in enumerate(texts):
        # chunk ids are hex digests in the service (chunking.chunk_id); plain here when they can be
        cid = f"{doc_id}-{t}" if doc_id.isalnum() else chunk_id(doc_id, "ctx", pos, pos + len(t), t)
        chunks.append(ChunkRecord(cid, i, pos, pos + len(t), t, "ctx"))
        pos += len(t) + 1
    return DocumentRecord(doc_id, " ".join(texts), title, meta or {}, "h", chunks)


def test_chunk_store_conformance(chunk_store: ChunkStore) -> None:
    emb = {f"a-{t}": np.full(4, 0.5, dtype=np.float32) for t in ["x", "y", "z"]}
    res = chunk_store.write([_doc("a", ["x", "y"], {"k": 1})], emb)
    assert (res.added, res.removed, res.unchanged) == (2, 0, 0)
    assert chunk_store.counts() == (1, 2)
    assert chunk_store.write([_doc("a", ["x", "y"], {"k": 1})], {}).unchanged == 2
    res = chunk_store.write([_doc("a", ["x", "z"], {"k": 2}, title="t2")], emb)
    assert (res.added, res.removed, res.unchanged) == (1, 1, 1)
    assert chunk_store.existing_chunk_ids(["a-x", "a-y", "a-z"]) == {"a-x", "a-z"}
    with pytest.raises(MissingEmbeddings) as exc:
        chunk_store.write([_doc("b", ["q"])], {})
    assert exc.value.chunk_ids == {"b-q"} and chunk_store.counts() == (1, 2)
    doc = chunk_store.get_document("a")
    assert doc is not None and doc.text == "x z" and doc.title == "t2" and doc.metadata == {"k": 2}
    assert [c.chunk_id for c in doc.chunk_list or []] == ["a-x", "a-z"]
    weird = 'id with "quotes", \\ and\nnewline'
    chunk_store.write(
        [_doc(weird, ["w"])], {c.chunk_id: np.zeros(4, dtype=np.float32) for c in _doc(weird, ["w"]).chunks}
    )
    page, total = chunk_store.list_documents(10, 0)
    assert total == 2 and [d.id for d in page] == sorted(["a", weird])
    assert chunk_store.delete_document(weird) and not chunk_store.delete_document(weird)
    assert chunk_store.delete_document("a")
    assert chunk_store.counts() == (0, 0) and chunk_store.get_document("a") is None
