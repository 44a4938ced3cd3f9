"""``tandem eval rag``: metrics computed from real pipeline runs (doubles for retrieval and inference)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from services.cli.eval_rag import load_beir, run_rag_eval
from services.cli.main import app
from tests.agent.stack import CORPUS, agent_stack


def write_beir(folder: Path) -> Path:
    (folder / "qrels").mkdir(parents=True)
    docs = CORPUS["geo"]
    (folder / "corpus.jsonl").write_text(
        "\n".join(json.dumps({"_id": k, "title": t, "text": x}) for k, (t, x) in docs.items())
    )
    queries = {
        "q1": "What is the capital of Germany?",
        "q2": "Where does the Eiffel Tower stand?",
        "q3": "Is France known for wine?",
    }
    (folder / "queries.jsonl").write_text(
        "\n".join(json.dumps({"_id": k, "text": v}) for k, v in queries.items())
    )
    (folder / "qrels" / "test.tsv").write_text(
        "query-id\tcorpus-id\tscore\nq1\tde\t1\nq2\teiffel\t1\nq3\tfr\t1\n"
    )
    return folder


def scripted_answer(body: dict[str, Any]) -> str:
    question = body["messages"][-1]["content"].rsplit("Question:", 1)[-1]
    if "Germany" in question:
        return "Berlin [1]."
    if "Eiffel" in question:
        return "In Paris [1], see also [7]."
    return "Yes, wine and cheese."  # no marker: the server attributes it, the metrics keep it apart


def test_rag_metrics(redis_url: str, tmp_path: Path, api_key: str) -> None:
    data = load_beir(write_beir(tmp_path / "beir"))
    with agent_stack(redis_url, tmp_path / "home") as s:
        s.model.replies = scripted_answer
        report = run_rag_eval(
            data,
            agent_url=s.url,
            retrieval_url=s.retrieval_url,
            api_key=api_key,
            collection="geo",
            limit=10,
            do_ingest=False,
        )
        summary = report.summary()
        assert summary["queries"] == 3 and summary["errors"] == 0
        assert summary["cited_chunk_relevance"] == 1.0 and summary["cited_chunks"] == 2
        assert summary["markers"] == 3 and summary["citation_validity"] == pytest.approx(2 / 3)
        assert summary["answers_with_citation"] == pytest.approx(2 / 3)
        assert (
            summary["answers_attributed_only"] == pytest.approx(1 / 3)
            and summary["attributed_relevance"] == 1.0
        )
        assert 0 < summary["first_token_p50_s"] <= summary["total_p95_s"]

        out = tmp_path / "out.json"
        result = CliRunner().invoke(
            app,
            [
                "eval",
                "rag",
                "--beir",
                str(tmp_path / "beir"),
                "--collection",
                "geo",
                "--no-ingest",
                "--api-key",
                api_key,
                "--agent-url",
                s.url,
                "--json",
                str(out),
            ],
        )
        assert result.exit_code == 0, result.output
        assert "citation validity" in result.output and "66.7%" in result.output
        assert json.loads(out.read_text())["summary"]["queries"] == 3


def test_missing_beir_files_are_a_clear_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["eval", "rag", "--beir", str(tmp_path), "--api-key", "k"])
    assert result.exit_code == 1 and "corpus.jsonl is missing" in " ".join(result.output.split())
