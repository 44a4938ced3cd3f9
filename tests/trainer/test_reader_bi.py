"""Bi-encoder reader jobs (``"reader_kind": "bi-encoder"``): a sentence encoder tuned listwise on
each question's candidate sentences, on a tiny random encoder with MiniLM's tokenizer. The
steps' questions and sentences are a function of the seed, training improves the held-out
ranking, a killed run resumes to the same loss, and a job through the API publishes a reader of
kind "bi-encoder" that ``/v1/rerank`` serves as cosines; a job that would continue a reader of
the other kind is refused naming ``base_model``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from services.common.readers import find_reader, reader_name, reader_passage
from services.trainer.data.formats import ReaderRecord, of_kind, parse_dataset
from services.trainer.recipes.base import NullHooks, TrainConfig, run
from services.trainer.recipes.reader_bi import (
    MAX_ANSWERING,
    MAX_OTHERS,
    BiEncoderReaderRecipe,
    question_groups,
    step_schedule,
)
from tests.conftest import auth
from tests.trainer.conftest import jsonl
from tests.trainer.test_api import Harness, upload
from tests.trainer.test_reader_job import config as reader_config
from tests.trainer.test_reader_job import harness, inference, post_job, reader_rows, rerank, tiny_st
from tests.trainer.test_recipes import KillAt

__all__ = ["harness", "inference", "tiny_st"]  # fixtures shared with the cross-encoder's tests

HP = {"learning_rate": 3e-3, "n_epochs": 8, "batch_size": 4, "warmup_steps": 2, "seed": 1}


def records(rows: list[dict[str, Any]]) -> list[ReaderRecord]:
    return of_kind(parse_dataset(jsonl(rows)).records, ReaderRecord)


def config(model: Path, work: Path | None, **hp: Any) -> TrainConfig:
    return reader_config(model, work, base=HP, checkpoint_every=5, **hp)


def test_questions_are_grouped_and_shown_answering_first_from_the_seed() -> None:
    rows = reader_rows()
    # a question of its own with no answering sentence teaches no ordering
    lonely = [
        {"question": "Is it open?", "sentence": f"Sentence {k}.", "label": 0, "group": "g"} for k in range(3)
    ]
    # one with more answering and other sentences than a step shows
    many = [
        {"question": "Why?", "sentence": f"Because {k}.", "label": int(k < 4), "group": "g"}
        for k in range(30)
    ]
    recs = records(rows + lonely + many)
    groups = question_groups(recs)
    assert len(groups) == len({(r["group"], r["question"]) for r in rows}) + 1
    assert all(recs[i].question != "Is it open?" for g in groups for i in g)
    steps = step_schedule(recs, groups, 3, 2, seed=7)
    assert steps == step_schedule(recs, groups, 3, 2, seed=7)
    assert steps != step_schedule(recs, groups, 3, 2, seed=8)
    shown = [q for step in steps for q in step]
    assert len(shown) == 2 * len(groups) and max(len(s) for s in steps) == 3
    for q in shown:
        labels = [recs[i].label for i in q]
        assert len({recs[i].question for i in q}) == 1
        assert labels == sorted(labels, reverse=True) and labels[0] == 1  # answering first
    why = [q for q in shown if recs[q[0]].question == "Why?"]
    assert [len(q) for q in why] == [MAX_ANSWERING + MAX_OTHERS] * 2
    assert why[0] != why[1]  # each epoch draws the sentences anew


def test_training_improves_the_held_out_ranking(tiny_st: Path) -> None:
    hooks = NullHooks()
    recipe = BiEncoderReaderRecipe(config(tiny_st, None), hooks=hooks)
    assert run(recipe) == "succeeded"
    m = recipe.last_metrics
    for k in ("auc", "mrr", "f1", "threshold"):
        assert f"eval_{k}_before" in m and f"eval_{k}_after" in m, sorted(m)
    assert m["eval_mrr_after"] > m["eval_mrr_before"] + 0.15, m
    assert m["eval_auc_after"] > m["eval_auc_before"] + 0.1, m
    assert -1.0 <= m["eval_threshold_after"] <= 1.0  # a cosine
    # 27 training questions (three places held out), 4 a step
    assert hooks.history[-1]["step"] == recipe.total_steps == 8 * 7
    assert np.mean([h["loss"] for h in hooks.history[-7:]]) < np.mean([h["loss"] for h in hooks.history[:7]])


def test_killed_run_resumes_to_the_same_final_loss(tiny_st: Path, tmp_path: Path) -> None:
    full = NullHooks()
    cfg = {"n_epochs": 2}
    a = tmp_path / "a"
    assert run(BiEncoderReaderRecipe(config(tiny_st, a, **cfg), hooks=full), a / "ckpt") == "succeeded"
    b = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):
        run(BiEncoderReaderRecipe(config(tiny_st, b, **cfg), hooks=KillAt(8)), b / "ckpt")
    again = NullHooks()
    assert run(BiEncoderReaderRecipe(config(tiny_st, b, **cfg), hooks=again), b / "ckpt") == "succeeded"
    assert [h["step"] for h in again.history] == list(range(6, 15))  # from step 5's checkpoint
    assert again.history[-1]["loss"] == pytest.approx(full.history[-1]["loss"], abs=1e-5)


def test_a_bi_encoder_reader_job_publishes_and_rerank_serves_its_cosines(
    harness: Harness, inference: str, api_key: str, tiny_st: Path, tandem_env: Path
) -> None:
    fid = upload(harness, api_key, jsonl(reader_rows())).json()["id"]
    body = {
        "type": "reader",
        "reader_kind": "bi-encoder",
        "base_model": str(tiny_st),
        "dataset": fid,
        "hyperparameters": {**HP, "n_epochs": 2},
    }
    queued = post_job(harness, api_key, body)
    assert queued.status_code == 201, queued.text
    jid = queued.json()["id"]
    assert harness.run_worker(jid) == "succeeded"
    name = reader_name(jid)
    hit = find_reader(tandem_env, "acme", name)
    assert hit is not None
    folder, manifest = hit
    assert manifest.kind == "bi-encoder" and manifest.threshold is not None

    from sentence_transformers import SentenceTransformer

    docs = [
        reader_passage("The zoo is located in Elm street.", "Zoo > Visiting"),
        reader_passage("The zoo was renovated last year.", "Zoo > Visiting"),
    ]
    served = rerank(inference, api_key, name, docs)
    assert served.status_code == 200, served.text
    vectors = SentenceTransformer(str(folder), device="cpu").encode(
        ["Where is the zoo?", *docs], normalize_embeddings=True
    )
    got = {r["index"]: r["relevance_score"] for r in served.json()["results"]}
    assert [got[0], got[1]] == pytest.approx([float(v) for v in vectors[1:] @ vectors[0]], abs=1e-5)

    # a reader goes on training as what it is
    cross = post_job(harness, api_key, {**body, "reader_kind": "cross-encoder", "base_model": name})
    assert cross.status_code == 400 and cross.json()["error"]["param"] == "base_model", cross.text
    assert "bi-encoder reader" in cross.json()["error"]["message"]
    further = post_job(harness, api_key, {**body, "base_model": name})
    assert further.status_code == 201, further.text
    # its defaults: one question a step, two passes at 2e-5, 128 tokens
    plain = post_job(harness, api_key, {"type": "reader", "reader_kind": "bi-encoder", "dataset": fid})
    hp = plain.json()["request"]["hyperparameters"]
    assert (hp["learning_rate"], hp["batch_size"], hp["n_epochs"], hp["max_seq_length"]) == (2e-5, 1, 2, 128)
    assert httpx.get(f"{harness.base}/v1/jobs/{jid}", headers=auth(api_key)).json()["published"] is True


def test_tandem_reader_train_starts_a_shared_bi_encoder_job_once(
    harness: Harness, key_store: Any, tandem_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from services.cli.reader import reader_app, start_reader_job

    rows, held = tmp_path / "rows.jsonl", tmp_path / "held.jsonl"
    rows.write_bytes(jsonl(reader_rows()[:24]))
    held.write_bytes(jsonl(reader_rows()[24:36]))
    operator = key_store.create("ops", operator=True)[0]
    job = start_reader_job(harness.base, operator, dataset=rows, eval_dataset=held, name="house-reader")
    request = httpx.get(f"{harness.base}/v1/jobs/{job.id}", headers=auth(operator)).json()["request"]
    assert request["reader_kind"] == "bi-encoder" and request["shared"] is True
    assert request["name"] == "house-reader" and request["eval_dataset"] is not None

    key_file = tmp_path / "key"
    key_file.write_text(operator)
    monkeypatch.setenv("TANDEM_HOME", str(tandem_env))
    args = ["train", "--trainer-url", harness.base, "--key-file", str(key_file), "--dataset", str(rows)]
    args += ["--eval-dataset", str(held), "--name", "house-reader", "--if-missing"]
    started = CliRunner().invoke(reader_app, args)
    assert started.exit_code == 0 and "publishes house-reader" in started.output, started.output
    assert len(harness.dispatched) == 2
    # once published, --if-missing starts nothing
    assert harness.run_worker(job.id) == "succeeded"
    again = CliRunner().invoke(reader_app, args)
    assert again.exit_code == 0 and "is published" in again.output, again.output
    assert len(harness.dispatched) == 2
    wrong = CliRunner().invoke(reader_app, [*args[:-1], "--kind", "llm"])
    assert wrong.exit_code == 2 and "'llm'" in wrong.output
