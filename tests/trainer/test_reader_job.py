"""Reader jobs: a cross-encoder that scores whether a sentence answers a question, trained on a
tiny random BERT with MiniLM's tokenizer. Rows checked on upload (the line named), the held-out
split by group or question, the held-out figures (AUC, accuracy, MRR, max-F1 threshold) before
and after, resume and cancel like the other recipes, and a job through the API that publishes
``ft-reader-<job>`` for its tenant (or, from an operator, for every tenant), served by the
inference service's ``/v1/rerank`` to that tenant only; the real Celery worker end to end."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from services.common.auth import KeyStore
from services.common.config import CommonSettings
from services.common.readers import (
    SHARED,
    find_reader,
    list_readers,
    reader_name,
    reader_passage,
    readers_root,
)
from services.trainer.app import create_app
from services.trainer.config import TrainerSettings
from services.trainer.data.formats import DatasetError, ReaderRecord, of_kind, parse_dataset
from services.trainer.jobspec import split_reader
from services.trainer.protocol import Hyperparameters
from services.trainer.recipes.base import NullHooks, TrainConfig, run
from services.trainer.recipes.reader import ReaderRecipe, auc, best_threshold, mean_reciprocal_rank
from tests.conftest import TEST_CACHE, auth
from tests.helpers.servers import celery_worker, serve_app
from tests.retrieval.conftest import make_tiny_embedder
from tests.trainer.conftest import jsonl
from tests.trainer.test_api import Harness, serving, upload
from tests.trainer.test_recipes import CancelAfter, KillAt

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PLACES = [
    "museum",
    "library",
    "bakery",
    "station",
    "harbour",
    "theatre",
    "gallery",
    "market",
    "school",
    "stadium",
    "pool",
    "zoo",
]
# What a question asks, and the sentence of each place that answers it.
ASKS = {
    "where": ("Where is the {p}?", "The {p} is located in Elm street."),
    "cost": ("How much does the {p} cost?", "A ticket for the {p} costs {n} euros."),
    "when": ("When does the {p} open?", "The {p} opens at {n} o'clock."),
}


def reader_rows() -> list[dict[str, Any]]:
    """Each place's three questions against its four sentences (one answers each question; one
    answers none), under the place's heading; three places to a group. Learnable (the kind of
    question decides which sentence answers) yet not solved by the random model."""
    rows = []
    for n, place in enumerate(PLACES):
        sentences = {kind: s.format(p=place, n=n + 3) for kind, (_, s) in ASKS.items()}
        sentences["none"] = f"The {place} was renovated last year."
        for kind, (question, _) in ASKS.items():
            for skind, sentence in sentences.items():
                rows.append(
                    {
                        "question": question.format(p=place),
                        "sentence": sentence,
                        "label": int(skind == kind),
                        "context": f"{place.title()} > Visiting",
                        "source": f"{place}.md",
                        "group": f"town-{n // 3}",
                    }
                )
    return rows


@pytest.fixture(scope="session")
def tiny_st() -> Path:
    root = TEST_CACHE / "retrieval-models"
    root.mkdir(parents=True, exist_ok=True)
    return make_tiny_embedder(root / "tiny-embedder")


HP = {"learning_rate": 5e-3, "n_epochs": 6, "batch_size": 16, "warmup_steps": 2, "seed": 1}


def config(
    model: Path, work: Path | None, *, base: dict[str, Any] = HP, checkpoint_every: int = 10, **hp: Any
) -> TrainConfig:
    """A reader recipe's config on ``reader_rows`` (a fifth of the groups held out): ``base``'s
    hyperparameters, ``hp`` over them."""
    records = of_kind(parse_dataset(jsonl(reader_rows())).records, ReaderRecord)
    train, held = split_reader(records, 0.2, 0)
    return TrainConfig(
        kind="reader",
        model_path=model,
        records=list(train),
        eval_records=list(held),
        hp=Hyperparameters.model_validate({**base, **hp}),
        checkpoint_every=checkpoint_every,
        work_dir=work,
    )


# ---- data
def test_reader_rows_are_recognised_and_checked_naming_line_and_field() -> None:
    good: dict[str, Any] = {"question": "Where is it?", "sentence": "It is here.", "label": 1}
    parsed = parse_dataset(jsonl([good, {**good, "label": 0, "context": "Guide > Place", "group": 7}]))
    assert parsed.format == "reader" and parsed.kinds == ("reader",)
    second = parsed.records[1]
    assert isinstance(second, ReaderRecord) and (second.label, second.group, second.context) == (
        0,
        "7",
        "Guide > Place",
    )
    cases: list[tuple[list[dict[str, Any]], int, str]] = [
        ([good, {**good, "label": 2}], 2, "label"),
        ([good, {"question": "q", "sentence": "s"}], 2, "label"),
        ([{**good, "sentence": " "}], 1, "sentence"),
        ([good, good, {**good, "question": ["not", "text"]}], 3, "question"),
        ([{**good, "context": 5}], 1, "context"),
        ([{**good, "group": []}], 1, "group"),
    ]
    for rows, line, field in cases:
        with pytest.raises(DatasetError) as err:
            parse_dataset(jsonl(rows))
        assert (err.value.line, err.value.field) == (line, field), str(err.value)
        assert f"line {line}" in str(err.value)
    with pytest.raises(DatasetError, match="line 2: malformed JSON"):
        parse_dataset(jsonl([good]) + b'{"question": "q", "sentence"\n')


def test_the_passage_is_the_context_then_the_sentence() -> None:
    assert reader_passage("It opens at 9.", "Museum > Visiting") == "Museum > Visiting\nIt opens at 9."
    assert reader_passage("It opens at 9.", None) == reader_passage("It opens at 9.", "") == "It opens at 9."


def test_held_out_rows_are_whole_groups_else_whole_questions() -> None:
    records = of_kind(parse_dataset(jsonl(reader_rows())).records, ReaderRecord)
    train, held = split_reader(records, 0.2, 0)
    # 4 groups: a fifth rounds to one, held out whole
    assert len({r.group for r in held}) == 1 and not {r.group for r in held} & {r.group for r in train}
    assert split_reader(records, 0.2, 0) == (train, held) != split_reader(records, 0.2, 5)
    ungrouped = [ReaderRecord(r.question, r.sentence, r.label, r.line) for r in records]
    train, held = split_reader(ungrouped, 0.2, 0)
    assert len({r.question for r in held}) == round(0.2 * 36)  # 36 questions
    assert not {r.question for r in held} & {r.question for r in train}


def test_held_out_figures_on_known_scores() -> None:
    labels = np.array([1, 0, 0, 1, 0, 0])
    scores = np.array([0.9, 0.2, 0.9, 0.4, 0.5, 0.1])
    # positives 0.9 and 0.4 against 0.2, 0.9, 0.5, 0.1: 0.9 beats 3 and ties 1; 0.4 beats 2
    assert auc(scores, labels) == pytest.approx((3.5 + 2) / 8)
    assert auc(scores, np.ones(6)) is None
    # question a: its answer ties a non-answer (rank 2); question b: its answer is beaten by 0.5
    questions = ["a", "a", "a", "b", "b", "b"]
    assert mean_reciprocal_rank(scores, labels, questions) == pytest.approx((1 / 2 + 1 / 2) / 2)
    f1, threshold = best_threshold(scores, labels) or (0.0, 0.0)
    # the cut under 0.4 takes both answers and two non-answers: F1 2*2 / (4 + 2)
    assert f1 == pytest.approx(4 / 6) and threshold == pytest.approx((0.4 + 0.2) / 2)
    assert best_threshold(scores, np.zeros(6)) is None


# ---- recipe
def test_training_improves_the_held_out_figures_and_reports_them(tiny_st: Path) -> None:
    hooks = NullHooks()
    recipe = ReaderRecipe(config(tiny_st, None), hooks=hooks)
    assert run(recipe) == "succeeded"
    m = recipe.last_metrics
    for k in ("auc", "accuracy", "mrr", "f1", "threshold"):
        assert f"eval_{k}_before" in m and f"eval_{k}_after" in m, sorted(m)
    assert m["eval_auc_after"] > m["eval_auc_before"] + 0.2, m
    assert m["eval_mrr_after"] > m["eval_mrr_before"] + 0.2, m
    assert 0.0 < m["eval_threshold_after"] < 1.0
    assert set(hooks.evals) == {"before", "after"}
    assert recipe.model.max_seq_length == 160  # the reader's default length
    first, last = hooks.history[0], hooks.history[-1]
    assert last["step"] == recipe.total_steps == 6 * 7  # 108 training rows in batches of 16
    assert np.mean([h["loss"] for h in hooks.history[-7:]]) < first["loss"]


def test_killed_reader_run_resumes_to_the_same_final_loss(tiny_st: Path, tmp_path: Path) -> None:
    full = NullHooks()
    cfg = {"n_epochs": 2}
    assert run(ReaderRecipe(config(tiny_st, tmp_path / "a", **cfg), hooks=full), tmp_path / "a" / "ckpt") == (
        "succeeded"
    )
    with pytest.raises(KeyboardInterrupt):
        run(ReaderRecipe(config(tiny_st, tmp_path / "b", **cfg), hooks=KillAt(12)), tmp_path / "b" / "ckpt")
    again = NullHooks()
    assert run(
        ReaderRecipe(config(tiny_st, tmp_path / "b", **cfg), hooks=again), tmp_path / "b" / "ckpt"
    ) == ("succeeded")
    assert [h["step"] for h in again.history] == list(range(11, 15))  # from step 10's checkpoint
    assert again.history[-1]["loss"] == pytest.approx(full.history[-1]["loss"], abs=1e-5)
    assert again.evals["after"]["eval_auc_before"] == full.evals["before"]["eval_auc_before"]
    assert again.evals["after"]["eval_auc_after"] == pytest.approx(full.evals["after"]["eval_auc_after"])


def test_reader_cancel_stops_within_one_step(tiny_st: Path) -> None:
    hooks = CancelAfter(2)
    assert run(ReaderRecipe(config(tiny_st, None), hooks=hooks)) == "cancelled"
    assert [h["step"] for h in hooks.history] == [1, 2]


# ---- through the API, then served
@pytest.fixture()
def harness(tandem_env: Path, tiny_st: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    with serving(tiny_st, tandem_env, monkeypatch) as h:
        yield h


def post_job(h: Harness, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{h.base}/v1/jobs", json=body, headers=auth(key), timeout=60)


def test_bad_reader_jobs_are_refused_before_anything_is_queued(
    harness: Harness, api_key: str, tiny_st: Path
) -> None:
    rows = reader_rows()
    bad = upload(harness, api_key, jsonl([rows[0], {**rows[1], "label": "yes"}]))
    assert bad.status_code == 400 and "line 2" in bad.json()["error"]["message"], bad.text
    assert bad.json()["error"]["param"] == "label"
    empty = upload(harness, api_key, b"\n\n")
    assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]
    fid = upload(harness, api_key, jsonl(rows)).json()["id"]
    answers_only = upload(harness, api_key, jsonl([r for r in rows if r["label"] == 1])).json()["id"]
    body = {"type": "reader", "base_model": str(tiny_st), "dataset": fid}
    for extra, status, needle, param in [
        ({"dataset": answers_only}, 400, "have label 1", "dataset"),
        ({"base_model": "no-such-model"}, 404, "'no-such-model'", "base_model"),
        ({"base_model": "ft-reader-0123"}, 404, "no such reader", "base_model"),
        ({"base_model": "ft-emb-0123"}, 404, "no such embedder", "base_model"),
        ({"lora": {"r": 4}}, 400, "'lora' does not apply to reader jobs", None),
        ({"resources": {"procs_per_node": 2}}, 400, "reader jobs run in one process", "resources"),
        ({"hyperparameters": {"hard_negatives": 2}}, 400, "only applies to embedder jobs", None),
        ({"shared": True}, 403, "only an operator key", "shared"),
        ({"name": "tandem-reader"}, 400, "'name' names a shared reader", None),
        ({"type": "sft", "base_model": "x"}, 400, "suits reader jobs, not sft", "dataset"),
    ]:
        resp = post_job(harness, api_key, {**body, **extra})
        assert resp.status_code == status, (needle, resp.text)
        assert needle in resp.json()["error"]["message"], (needle, resp.json())
        if param:
            assert resp.json()["error"]["param"] == param
    assert harness.dispatched == []
    # the base defaults to the offline all-MiniLM-L6-v2, and the job publishes
    queued = post_job(harness, api_key, {"type": "reader", "dataset": fid})
    assert queued.status_code == 201, queued.text
    request = queued.json()["request"]
    assert request["base_model"] == "all-MiniLM-L6-v2" and request["publish"] is True
    assert request["eval_fraction"] == 0.2
    hp = request["hyperparameters"]
    assert (hp["learning_rate"], hp["batch_size"], hp["max_seq_length"]) == (4e-5, 32, 160)
    assert len(harness.dispatched) == 1


@pytest.fixture()
def inference(tandem_env: Path, tiny_model_path: Path, redis_url: str) -> Iterator[str]:
    """The inference service over the trainer's home (where readers are published)."""
    from services.inference.app import create_app as inference_app
    from services.inference.config import InferenceSettings

    common = CommonSettings(home=tandem_env, redis_url=redis_url, log_json=False)
    settings = InferenceSettings(
        model=str(tiny_model_path), served_model_name="tiny", max_model_len=128, embedding_dtype="float32"
    )
    with serve_app(inference_app(common, settings)) as url:
        yield url


def rerank(url: str, key: str, model: str, documents: list[str]) -> httpx.Response:
    body = {"model": model, "query": "Where is the zoo?", "documents": documents}
    return httpx.post(f"{url}/v1/rerank", json=body, headers=auth(key), timeout=60)


def test_a_reader_job_publishes_for_its_tenant_and_rerank_serves_it(
    harness: Harness,
    inference: str,
    api_key: str,
    other_key: str,
    key_store: KeyStore,
    tiny_st: Path,
    tandem_env: Path,
) -> None:
    fid = upload(harness, api_key, jsonl(reader_rows())).json()["id"]
    body = {"type": "reader", "base_model": str(tiny_st), "dataset": fid, "hyperparameters": HP}
    jid = post_job(harness, api_key, body).json()["id"]
    assert harness.run_worker(jid) == "succeeded"
    job = httpx.get(f"{harness.base}/v1/jobs/{jid}", headers=auth(api_key)).json()
    name = reader_name(jid)
    assert job["fine_tuned_model"] == name and job["published"] is True
    m = job["metrics"]
    assert m["eval_auc_after"] > m["eval_auc_before"] and "eval_mrr_after" in m, m
    hit = find_reader(tandem_env, "acme", name)
    assert hit is not None
    folder, manifest = hit
    assert folder.parent == readers_root(tandem_env) / "acme" and manifest.tenant == "acme"
    assert manifest.threshold == pytest.approx(m["eval_threshold_after"], abs=1e-6)
    assert manifest.metrics["auc"] == pytest.approx(m["eval_auc_after"], abs=1e-6)
    assert manifest.metrics["auc_before"] == pytest.approx(m["eval_auc_before"], abs=1e-6)
    assert json.loads((folder / "tandem_reader.json").read_text())["job_id"] == jid
    assert find_reader(tandem_env, "globex", name) is None and list_readers(tandem_env, "globex") == []

    # served to its tenant, with the scores the trainer's model gives
    from sentence_transformers import CrossEncoder

    docs = [
        reader_passage("The zoo is located in Elm street.", "Zoo > Visiting"),
        reader_passage("The zoo was renovated last year.", "Zoo > Visiting"),
    ]
    served = rerank(inference, api_key, name, docs)
    assert served.status_code == 200, served.text
    expected = CrossEncoder(str(folder), device="cpu").predict([("Where is the zoo?", d) for d in docs])
    got = {r["index"]: r["relevance_score"] for r in served.json()["results"]}
    assert [got[0], got[1]] == pytest.approx([float(x) for x in expected], abs=1e-5)
    cards = httpx.get(f"{inference}/v1/models", headers=auth(api_key)).json()["data"]
    card = next(c for c in cards if c["id"] == name)
    assert card["kind"] == "rerank" and card["threshold"] == pytest.approx(manifest.threshold)
    # another tenant: as if it did not exist
    theirs = rerank(inference, other_key, name, docs)
    assert theirs.status_code == 404 and theirs.json()["error"]["param"] == "model", theirs.text
    assert name in theirs.json()["error"]["message"]
    assert name not in {
        c["id"] for c in httpx.get(f"{inference}/v1/models", headers=auth(other_key)).json()["data"]
    }

    # an operator's shared reader (trained further from the tenant's) serves every tenant
    operator = key_store.create("ops", operator=True)[0]
    ops_fid = upload(harness, operator, jsonl(reader_rows())).json()["id"]
    shared_body = {**body, "dataset": ops_fid, "shared": True, "hyperparameters": {"max_steps": 2}}
    from_theirs = post_job(harness, operator, {**shared_body, "base_model": name})
    assert from_theirs.status_code == 404, from_theirs.text  # acme's reader is not the operator's
    sid = post_job(harness, operator, shared_body).json()["id"]
    assert harness.run_worker(sid) == "succeeded"
    shared = reader_name(sid)
    assert find_reader(tandem_env, SHARED, shared) is not None
    for key in (api_key, other_key):
        assert rerank(inference, key, shared, docs).status_code == 200
        assert shared in {m.name for m in list_readers(tandem_env, "globex")}
    # and a tenant may train further from a shared reader
    assert (
        post_job(
            harness,
            other_key,
            {
                **body,
                "dataset": upload(harness, other_key, jsonl(reader_rows())).json()["id"],
                "base_model": shared,
            },
        ).status_code
        == 201
    )


@pytest.mark.e2e
def test_reader_job_through_a_real_worker_publishes(
    tandem_env: Path, tiny_st: Path, api_key: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tests.trainer.test_e2e import create_job, finished_job, worker_env

    monkeypatch.setenv("TANDEM_MODEL_ROOTS", f"{tiny_st.parent}:{tandem_env / 'models'}")
    log = tmp_path / "worker.log"
    app = create_app(CommonSettings(), TrainerSettings())
    with serve_app(app) as base, celery_worker(worker_env({}), log, "w1"):
        up = httpx.post(
            f"{base}/v1/files", files={"file": ("reader.jsonl", jsonl(reader_rows()))}, headers=auth(api_key)
        )
        assert up.status_code == 201 and up.json()["format"] == "reader", up.text
        body = {
            "type": "reader",
            "base_model": str(tiny_st),
            "dataset": up.json()["id"],
            "hyperparameters": HP,
        }
        jid = create_job(base, api_key, body)
        done = finished_job(base, api_key, jid, log)
    assert done["status"] == "succeeded", done["error"]
    assert done["fine_tuned_model"] == reader_name(jid)
    hit = find_reader(tandem_env, "acme", reader_name(jid))
    assert hit is not None and hit[1].threshold is not None
    assert done["metrics"]["eval_auc_after"] > done["metrics"]["eval_auc_before"]
