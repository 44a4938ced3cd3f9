"""An embedder job's labelled pairs as its collection's chunks (``positives: "chunks"``) with hard
negatives from the collection's own hybrid search (``hard_negatives_from: "collection"``), issue
17. The real retrieval service (the tiny random embedder) and the trainer over HTTP; the job's
worker in process."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from services.trainer.data.pairs import chunk_positives, ranked_negatives
from tests.conftest import auth
from tests.trainer.conftest import jsonl
from tests.trainer.test_embedder import TOPICS, tiny_st

os.environ.setdefault("HF_HUB_OFFLINE", "1")
__all__ = ["tiny_st"]  # a fixture, used here by name

WORDS = TOPICS.split()


def test_ranked_negatives_skip_documents_not_chunks_and_never_take_a_positive() -> None:
    ranked = [
        ("a", "a1"),
        ("a", "a2"),  # a's second chunk: rank 0 is a's, whatever follows
        ("b", "b1"),
        ("pos", "p1"),
        ("c", "c1"),
        ("d", "inside the positive text"),
        ("e", "e1"),
        ("f", "f1"),
    ]
    positive = "a passage holding inside the positive text and more"
    # skip counts distinct documents (a, b); the positive document and the overlapping chunk are dropped
    got = ranked_negatives(ranked, {"pos"}, positive, skip=2, count=2)
    assert got == ["c1", "e1"]
    assert ranked_negatives(ranked, {"pos"}, positive, skip=0, count=3) == ["a1", "b1", "c1"]
    assert ranked_negatives(ranked, {"pos"}, positive, skip=6, count=5) == ["f1"]  # fewer left than asked


def test_a_positive_becomes_its_documents_chunk_nearest_the_query(tiny_st: Path) -> None:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(tiny_st), device="cpu")
    chunks = {"d1": [f"Doc\nthe {w} is here" for w in WORDS[:5]], "d2": ["Other\nonly chunk"]}
    pairs = [
        {"query": f"where is the {WORDS[3]}", "positive": "whole d1", "corpus_id": "d1"},
        {"query": "the other one", "positive": "whole d2", "document_id": "d2"},
        {"query": "a text pair", "positive": "stays as given"},
        {"query": "outside", "positive": "kept too", "document_id": "not-in-chunks"},
    ]
    got, mapped = chunk_positives(model, pairs, chunks)
    assert mapped == 2
    q = model.encode([pairs[0]["query"]], normalize_embeddings=True)[0]
    scores = model.encode(chunks["d1"], normalize_embeddings=True) @ q
    assert got[0]["positive"] == chunks["d1"][int(np.argmax(scores))]
    assert got[1]["positive"] == "Other\nonly chunk"
    assert [g["positive"] for g in got[2:]] == ["stays as given", "kept too"]
    assert got[0]["corpus_id"] == "d1" and pairs[0]["positive"] == "whole d1"  # the input is not changed


def docs() -> list[dict[str, Any]]:
    """Eight documents of several chunks each (chunks of 16 tokens), two with headings."""
    out = []
    for i, w in enumerate(WORDS[:8]):
        body = " ".join(f"The {w} sentence {j} says something about the {w}." for j in range(6))
        if i < 2:
            body = f"# Part {w}\n{body}\n# More {w}\n{body}"
        out.append({"id": f"doc{i}", "title": f"All about the {w}", "text": body})
    return out


def test_an_embedder_job_trains_on_the_collections_chunks_with_negatives_from_its_search(
    tandem_env: Path, tiny_st: Path, api_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """POST /v1/jobs reads the collection's chunks (title and headings, then the chunk, as
    indexed) and searches it for each training query; the worker trains on the chunks and
    those negatives; bad input is a 400 naming the row and the document."""
    from services.retrieval.app import create_app as retrieval_app
    from services.trainer import chunk_pairs
    from services.trainer.paths import job_dir
    from tests.helpers.servers import serve_app
    from tests.trainer.test_api import serving, upload

    monkeypatch.setenv("TANDEM_RETRIEVAL_EMBEDDING_MODEL", str(tiny_st))
    monkeypatch.setenv("TANDEM_MODEL_ROOTS", str(tiny_st.parent))
    collection = docs()
    with (
        serve_app(retrieval_app()) as r_url,
        serving(tiny_st, tandem_env, monkeypatch) as h,
        httpx.Client(headers=auth(api_key), timeout=120) as c,
    ):
        h.st.common = h.st.common.model_copy(update={"retrieval_url": r_url})
        made = c.post(f"{r_url}/v1/collections", json={"name": "kb", "chunking": {"size": 16, "overlap": 0}})
        assert made.status_code == 201, made.text
        assert (
            c.post(f"{r_url}/v1/collections/kb/documents", json={"documents": collection}).status_code == 201
        )
        beir: list[dict[str, Any]] = [
            {"corpus_id": d["id"], "title": d["title"], "text": d["text"]} for d in collection
        ]
        queries = {f"q{i}": f"what does sentence {i} say about the {WORDS[i]}" for i in range(6)}
        beir += [{"query_id": q, "text": t} for q, t in queries.items()]
        beir += [{"query_id": f"q{i}", "corpus_id": f"doc{i}"} for i in range(6)]
        fid = upload(h, api_key, jsonl(beir)).json()["id"]
        body = {
            "type": "embedder",
            "base_model": str(tiny_st),
            "dataset": fid,
            "collection": "kb",
            "positives": "chunks",
            "title_pairs": False,
            "hyperparameters": {
                "hard_negatives": 2,
                "hard_negatives_from": "collection",
                "hard_negatives_skip": 1,
                "batch_size": 4,
                "max_steps": 2,
            },
        }
        created = c.post(f"{h.base}/v1/jobs", json=body)
        assert created.status_code == 201, created.text
        job = created.json()
        prepared = chunk_pairs.load(job_dir(h.st.common, job["id"]))
        # each named document's chunks, as the retrieval service indexes them
        for i in range(6):
            doc = c.get(f"{r_url}/v1/collections/kb/documents/doc{i}").json()
            want = [
                (f"{s['context']}\n" if s["context"] else "") + doc["text"][s["start"] : s["end"]]
                for s in doc["chunk_list"]
            ]
            assert prepared.chunks[f"doc{i}"] == want and len(want) >= 3
            assert all(w.startswith(f"All about the {WORDS[i]}") for w in want)
        assert any("> Part" in t for t in prepared.chunks["doc0"])  # a heading is part of the context
        assert set(prepared.chunks) == {f"doc{i}" for i in range(6)}  # no title pairs: the labelled only
        # each query's negatives: the best-ranked chunk of each document its search ranks from 1 on
        # (ranks over documents), its own document left out
        indexed = {}
        for d in collection:
            doc = c.get(f"{r_url}/v1/collections/kb/documents/{d['id']}").json()
            for s in doc["chunk_list"]:
                text = doc["text"][s["start"] : s["end"]]
                indexed[s["chunk_id"]] = f"{s['context']}\n{text}" if s["context"] else text
        for i, q in enumerate(queries.values()):
            hits = c.post(
                f"{r_url}/v1/collections/kb/search", json={"query": q, "top_k": 50, "mode": "hybrid"}
            ).json()["results"]
            best: dict[str, str] = {}
            for hit in hits:
                best.setdefault(hit["document_id"], indexed[hit["chunk_id"]])
            want = [t for d, t in list(best.items())[1:] if d != f"doc{i}"][:2]
            assert prepared.negatives[q] == want and len(want) == 2

        assert h.run_worker(job["id"]) == "succeeded"
        log = "\n".join(m["message"] for m in h.st.store.logs(job["id"]))
        assert "positives: 6 pairs train on their document's chunk nearest the query" in log, log
        assert "hard negatives:" not in log  # nothing mined by the model: the collection's are used

        # bad input: each a 400 naming it
        text_only = upload(
            h, api_key, jsonl([{"query": "q", "positive": "p"}, {"query": "r", "positive": "s"}])
        )
        # the file holds the document, the collection does not
        nowhere = [{"corpus_id": "nowhere", "title": "", "text": "Not ingested."}]
        outside = upload(h, api_key, jsonl([*beir, *nowhere, {"query_id": "q0", "corpus_id": "nowhere"}]))
        assert outside.status_code == 201, outside.text
        outside_fid = outside.json()["id"]
        for change, needle in [
            ({"dataset": text_only.json()["id"]}, "line 1: positives 'chunks' needs each pair to name"),
            ({"dataset": outside_fid}, "document 'nowhere' is not a document of collection 'kb'"),
            ({"collection": None}, "positives 'chunks' needs the job's 'collection'"),
            (
                {"positives": "documents", "collection": None},
                "hard_negatives_from 'collection' needs the job's 'collection'",
            ),
            (
                {"hyperparameters": {"hard_negatives_from": "collection", "hard_negatives": 0}},
                "set hyperparameters.hard_negatives above 0",
            ),
            ({"dataset": None}, "title_pairs false leaves a job"),
        ]:
            bad = {k: v for k, v in {**body, **change}.items() if v is not None}
            resp = c.post(f"{h.base}/v1/jobs", json=bad)
            assert resp.status_code == 400, (change, resp.text)
            err = resp.json()["error"]
            assert needle in err["message"], (change, err)
        sft = c.post(f"{h.base}/v1/jobs", json={**body, "type": "sft"})
        assert sft.status_code == 400 and "only applies to embedder jobs" in sft.text
        assert json.loads(created.text)["collection"] == "kb"
