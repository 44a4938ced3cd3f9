"""Reranking through the search path (tiny random cross-encoder), and `tandem eval retrieval`
against the running service on a small BEIR-layout set made here."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from services.cli.main import app as cli_app
from services.common.ranking import mrr_at, ndcg_at, recall_at
from services.retrieval.config import RetrievalSettings
from services.retrieval.core.collection import InputDocument
from services.retrieval.core.registry import CollectionManager
from tests.retrieval.test_protocols import make_tiny_cross_encoder


def test_search_with_rerank(tmp_path: Path, tiny_embedder: Path, model_root: Path) -> None:
    ce = make_tiny_cross_encoder(model_root / "tiny-cross-encoder")
    settings = RetrievalSettings(embedding_model=str(tiny_embedder), reranker_model=str(ce), rerank_depth=20)
    m = CollectionManager(tmp_path, settings, [model_root])
    m.create("t", "c")
    col = m.get("t", "c")
    col.ingest(
        [InputDocument(f"d{i}", f"passage number {i} about rivers and lakes", "", {}) for i in range(15)]
    )
    hits = col.search("rivers", top_k=5, mode="hybrid", rerank=True)
    assert len(hits) == 5
    assert all(set(h.scores) >= {"hybrid", "rerank"} for h in hits)
    rr = [h.scores["rerank"] for h in hits]
    assert rr == sorted(rr, reverse=True) and [h.score for h in hits] == rr
    # the reranker saw the first-stage candidates, not only the top 5
    plain = col.search("rivers", top_k=15, mode="hybrid")
    assert {h.chunk_id for h in hits} <= {h.chunk_id for h in plain}
    m.close_all()


def test_metrics() -> None:
    rel = {"a": 1, "b": 2}
    assert ndcg_at(["b", "a", "x"], rel, 10) == pytest.approx(1.0)
    assert ndcg_at(["x", "a", "b"], rel, 10) < ndcg_at(["a", "b", "x"], rel, 10) < 1.0
    assert recall_at(["x", "a"], rel, 100) == 0.5
    assert mrr_at(["x", "y", "b"], rel, 10) == pytest.approx(1 / 3)
    assert mrr_at(["x"], rel, 10) == 0.0


def test_eval_cli_against_the_service(service: str, api_key: str, tmp_path: Path) -> None:
    beir = tmp_path / "mini"
    (beir / "qrels").mkdir(parents=True)
    topics = [
        "volcano lava eruption",
        "glacier ice valley",
        "coral reef ocean",
        "desert sand dune",
        "forest tree canopy",
    ]
    with (beir / "corpus.jsonl").open("w") as f:
        for i, t in enumerate(topics):
            f.write(
                json.dumps(
                    {"_id": f"c{i}", "title": t.split()[0], "text": f"All about the {t} and more {t}."}
                )
                + "\n"
            )
    with (beir / "queries.jsonl").open("w") as f:
        for i, t in enumerate(topics):
            f.write(json.dumps({"_id": f"q{i}", "text": t.split()[1]}) + "\n")
    (beir / "qrels" / "test.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\tc{i}\t1\n" for i in range(len(topics)))
    )
    out = tmp_path / "scores.json"
    result = CliRunner().invoke(
        cli_app,
        [
            "eval",
            "retrieval",
            "--beir",
            str(beir),
            "--url",
            service,
            "--api-key",
            api_key,
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "nDCG@10" in result.output and "hybrid" in result.output
    scores = {s["mode"]: s for s in json.loads(out.read_text())}
    assert set(scores) == {"dense", "sparse", "hybrid"}
    # single exact-term queries: BM25 is perfect, hybrid at least finds each in the top 10
    assert scores["sparse"]["ndcg10"] == pytest.approx(1.0)
    assert scores["hybrid"]["recall100"] == pytest.approx(1.0)
    # the collection was made through the API
    info = httpx.get(
        f"{service}/v1/collections/beir-mini", headers={"Authorization": f"Bearer {api_key}"}
    ).json()
    assert info["documents"] == 5
    # a bad key is reported, not a traceback
    bad = CliRunner().invoke(
        cli_app, ["eval", "retrieval", "--beir", str(beir), "--url", service, "--api-key", "tdm_x_y"]
    )
    assert bad.exit_code == 1 and "401" in bad.output
    missing = CliRunner().invoke(
        cli_app, ["eval", "retrieval", "--beir", str(tmp_path), "--url", service, "--api-key", api_key]
    )
    assert missing.exit_code == 2 and "corpus.jsonl" in missing.output
