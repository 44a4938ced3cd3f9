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
            pipeline="chat-documents-generate",  # the model's markers are what is scored here
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
        # chat-documents (the default) answers with cited source sentences: they are scored too
        shipped = run_rag_eval(
            data, agent_url=s.url, retrieval_url=s.retrieval_url, api_key=api_key, collection="geo",
            limit=10, do_ingest=False,
        ).summary()  # fmt: skip
        assert shipped["cited_chunks"] >= 1 and shipped["cited_chunk_relevance"] is not None

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
                "--pipeline",
                "chat-documents-generate",
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


# -- the invented-facts question set (``tandem eval rag --facts``) -------------------------------


def _cite(doc: str, kind: str = "cited", index: int = 1) -> dict[str, Any]:
    return {"index": index, "document_id": doc, "kind": kind}


def test_fact_metrics_of_hand_made_answers() -> None:
    from services.cli.eval_rag import facts_summary, judge_fact
    from services.cli.factset import make_facts

    facts = make_facts(4, seed=3)
    docs = [f.text for f in facts]
    a, b, c, d = facts

    good = judge_fact(
        a,
        {
            "answer": f"{a.sentence[:-1]} [1].",
            "done": {"citations": [_cite(a.fact_id)]},
            "first": 0.5,
            "total": 2.0,
        },
        docs,
    )
    assert (good.stated, good.right_doc, good.valid_citation, good.model_marker, good.model_right_doc) == (
        True,
        True,
        True,
        True,
        True,
    )
    assert (good.repeated, good.groundedness, good.extractive) == (False, 1.0, False)

    # States the fact but only the server attributed a (wrong) document: not the model's citation.
    loop = f"{b.sentence} {b.sentence}"
    wrong = judge_fact(
        b,
        {"answer": loop, "done": {"citations": [_cite(c.fact_id, "attributed")]}, "first": 0.4, "total": 4.0},
        docs,
    )
    assert (wrong.stated, wrong.right_doc, wrong.valid_citation, wrong.model_marker) == (
        True,
        False,
        True,
        False,
    )
    assert wrong.repeated

    # The guard answered from the sources: extractive citations count for the right document,
    # never as the model's own marker.
    extr = judge_fact(
        c,
        {
            "answer": f"{c.sentence[:-1]} [2].",
            "done": {"kind": "extractive", "citations": [_cite(c.fact_id, "extractive", 2)]},
            "first": 1.0,
            "total": 1.0,
        },
        docs,
    )
    assert (extr.stated, extr.right_doc, extr.extractive, extr.model_marker) == (True, True, True, False)

    # A made-up answer: nothing stated, nothing cited, its sentence unsupported.
    made_up = judge_fact(
        d, {"answer": "It was built by Zorblax the Great.", "done": {}, "first": None, "total": 3.0}, docs
    )
    assert (made_up.stated, made_up.right_doc, made_up.valid_citation, made_up.groundedness) == (
        False,
        False,
        False,
        0.0,
    )

    s = facts_summary([good, wrong, extr, made_up])
    assert (s["questions"], s["fact_stated"], s["right_document_cited"], s["valid_citation"]) == (
        4,
        0.75,
        0.5,
        0.75,
    )
    assert (s["model_wrote_marker"], s["extractive"], s["repeated_sentence"]) == (0.25, 0.25, 0.25)
    assert s["first_token_p50_s"] == 0.5 and s["total_p50_s"] in (2.0, 3.0)


def test_eval_rag_wants_one_question_set() -> None:
    result = CliRunner().invoke(app, ["eval", "rag", "--api-key", "k"])
    assert result.exit_code == 2
    assert "exactly one of --beir DIR, --facts N and --questions FILE" in result.output
