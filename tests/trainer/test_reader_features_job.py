"""Reader jobs with ``"reader_kind": "features"``: a small model over the answer step's signals.
Rows carry ``features`` (checked on upload, the line named), the recipe fits in full-batch steps
and its held-out figures improve, and a job through the API keeps ``feature_reader.json`` as its
artifact, which the agent's scorer loads."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from services.agent.reader.features import FEATURES, FeatureModel
from services.trainer.data.formats import DatasetError, ReaderRecord, of_kind, parse_dataset
from services.trainer.jobspec import split_reader
from services.trainer.paths import artifact_dir
from services.trainer.protocol import Hyperparameters
from services.trainer.recipes.base import NullHooks, TrainConfig, run
from services.trainer.recipes.reader_features import ARTIFACT, FeatureReaderRecipe, fit
from tests.conftest import auth
from tests.trainer.conftest import jsonl
from tests.trainer.test_api import Harness, serving, upload


def feature_rows(questions: int = 24, per_question: int = 5, seed: int = 3) -> list[dict[str, Any]]:
    """Per question one answering sentence among ``per_question``: it is the one most similar to
    the question (``cos_sentence``) and holding most of its words, with noise elsewhere."""
    rng = random.Random(seed)
    rows = []
    for q in range(questions):
        answer = rng.randrange(per_question)
        for k in range(per_question):
            values = {name: rng.uniform(-1, 1) for name in FEATURES}
            values["cos_sentence"] = rng.uniform(0.55, 0.8) if k == answer else rng.uniform(0.1, 0.5)
            values["words_sentence"] = rng.uniform(0.6, 1.0) if k == answer else rng.uniform(0.0, 0.5)
            rows.append(
                {
                    "question": f"question {q}",
                    "sentence": f"sentence {k} of question {q}",
                    "label": int(k == answer),
                    "group": f"set-{q % 4}",
                    "features": values,
                }
            )
    return rows


def test_feature_rows_are_checked_naming_line_and_field() -> None:
    rows = feature_rows(2)
    parsed = of_kind(parse_dataset(jsonl(rows)).records, ReaderRecord)
    assert parsed[0].features is not None and list(parsed[0].features) == list(FEATURES)
    for bad in (
        {"features": "cos 0.5"},
        {"features": {}},
        {"features": {"cos": "high"}},
        {"features": {"cos": True}},
    ):
        with pytest.raises(DatasetError) as err:
            parse_dataset(jsonl([rows[0], {**rows[1], **bad}]))
        assert (err.value.line, err.value.field) == (2, "features"), str(err.value)
        assert "line 2" in str(err.value)


def test_fitting_learns_the_signal_and_the_recipe_reports_held_out_figures() -> None:
    records = of_kind(parse_dataset(jsonl(feature_rows())).records, ReaderRecord)
    train, held = split_reader(records, 0.25, 0)
    hooks = NullHooks()
    cfg = TrainConfig(
        kind="reader",
        model_path=Path("features"),
        records=list(train),
        eval_records=list(held),
        hp=Hyperparameters.model_validate(
            {"learning_rate": 0.05, "n_epochs": 30, "batch_size": 32, "seed": 0}
        ),
    )
    recipe = FeatureReaderRecipe(cfg, hooks=hooks)
    assert run(recipe) == "succeeded"
    m = recipe.last_metrics
    assert m["eval_auc_after"] > 0.95 and m["eval_mrr_after"] > 0.9, m
    assert hooks.history[-1]["loss"] < hooks.history[0]["loss"]
    assert recipe.total_steps == 30 * 3  # 90 training rows in batches of 32
    # the one-call fit (what benchmarks/answers/reader_eval.py runs) learns the same
    x = np.array([[r.features[n] for n in FEATURES] for r in train if r.features], dtype=np.float32)
    y = np.array([r.label for r in train], dtype=np.float32)
    net = fit(x, y, epochs=30, batch_size=32, lr=0.05)
    p = net.probabilities(x)
    assert p[y == 1].mean() > p[y == 0].mean() + 0.3


@pytest.fixture()
def harness(tandem_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    (tmp_path / "none").mkdir()
    with serving(tmp_path / "none", tandem_env, monkeypatch) as h:
        yield h


def post_job(h: Harness, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{h.base}/v1/jobs", json=body, headers=auth(key), timeout=60)


def test_a_features_job_trains_and_its_artifact_loads_in_the_agent(
    harness: Harness, api_key: str, tandem_env: Path
) -> None:
    rows = feature_rows()
    bad = upload(harness, api_key, jsonl([rows[0], {**rows[1], "features": [0.5]}]))
    assert bad.status_code == 400 and "line 2" in bad.json()["error"]["message"], bad.text
    assert bad.json()["error"]["param"] == "features"
    empty = upload(harness, api_key, b"\n\n")
    assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]
    plain = upload(harness, api_key, jsonl([{k: v for k, v in r.items() if k != "features"} for r in rows]))
    body = {"type": "reader", "reader_kind": "features", "dataset": plain.json()["id"]}
    missing = post_job(harness, api_key, body)
    assert missing.status_code == 400 and "line 1 has no 'features'" in missing.json()["error"]["message"]
    published = post_job(harness, api_key, {**body, "publish": True})
    assert published.status_code == 400 and "job's artifact" in published.text
    wrong_type = post_job(harness, api_key, {"type": "sft", "base_model": "x", "reader_kind": "features"})
    assert wrong_type.status_code == 400
    assert harness.dispatched == []

    fid = upload(harness, api_key, jsonl(rows)).json()["id"]
    queued = post_job(harness, api_key, {**body, "dataset": fid})
    assert queued.status_code == 201, queued.text
    request = queued.json()["request"]
    assert request["publish"] is False and request["hyperparameters"]["n_epochs"] == 20
    jid = queued.json()["id"]
    assert harness.run_worker(jid) == "succeeded"
    job = httpx.get(f"{harness.base}/v1/jobs/{jid}", headers=auth(api_key)).json()
    assert job["status"] == "succeeded"
    out = artifact_dir(harness.st.common, jid)
    model = FeatureModel.load(out)
    assert 0.0 < model.threshold < 1.0
    x = np.array([[r["features"][n] for n in FEATURES] for r in rows], dtype=np.float32)
    y = np.array([r["label"] for r in rows])
    p = model.probabilities(x)
    assert p[y == 1].mean() > p[y == 0].mean() + 0.3
    assert json.loads((out / ARTIFACT).read_text())["features"] == list(FEATURES)
