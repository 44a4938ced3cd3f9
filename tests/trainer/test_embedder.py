"""Embedder jobs (issue 17) on a tiny random sentence-transformer with MiniLM's tokenizer:
pairs and BEIR rows checked on upload, held-out nDCG@10 / Recall@100 before and after, a job
through the API that publishes ``ft-emb-<job>`` for its tenant only, a collection's titles as
label-free pairs read over the retrieval service's HTTP API, resume and cancel like the other
recipes, and the real Celery worker end to end."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.common.config import CommonSettings
from services.common.embedders import embedder_name, find_embedder, list_embedders
from services.trainer.app import create_app
from services.trainer.config import TrainerSettings
from services.trainer.data.formats import DatasetError, parse_dataset
from services.trainer.data.pairs import LABELLED_STAGE, TITLE_STAGE, embedder_data, retrieval_set, title_pairs
from services.trainer.jobspec import split_eval
from services.trainer.protocol import Hyperparameters
from services.trainer.recipes.base import NullHooks, TrainConfig, run
from services.trainer.recipes.embedder import EmbedderRecipe, batch_schedule
from tests.conftest import TEST_CACHE, auth
from tests.helpers.servers import celery_worker, free_port, serve_app
from tests.retrieval.conftest import make_tiny_embedder
from tests.trainer.conftest import jsonl
from tests.trainer.test_api import Harness, serving, upload
from tests.trainer.test_recipes import CancelAfter, KillAt

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOPICS = "apple river engine violin planet bread winter copper falcon garden laser ocean pencil tiger castle coffee"
# two queries per topic, each with its own passage: learnable (the topic word is shared) yet
# not solved by the random encoder, so training moves the held-out ranking
PAIRS = [
    {"query": f"what about {t} number {i}?", "positive": f"A passage on {t}: the {t} is discussed, part {i}."}
    for t in TOPICS.split()
    for i in range(2)
]


@pytest.fixture(scope="session")
def tiny_st() -> Path:
    root = TEST_CACHE / "retrieval-models"
    root.mkdir(parents=True, exist_ok=True)
    return make_tiny_embedder(root / "tiny-embedder")


def config(model: Path, work: Path | None, **hp: Any) -> TrainConfig:
    records = embedder_data(parse_dataset(jsonl(PAIRS)).records).pairs
    train, held = split_eval(records, 0.25, 0)
    return TrainConfig(
        kind="embedder",
        model_path=model,
        records=train,
        eval_records=held,
        hp=Hyperparameters.model_validate(
            {"learning_rate": 1e-3, "n_epochs": 4, "batch_size": 8, "seed": 1, **hp}
        ),
        checkpoint_every=2,
        work_dir=work,
    )


# ---- data
def test_pair_and_beir_rows_are_checked_naming_line_and_field() -> None:
    cases = [
        ([{"query": "q", "positive": "p"}, {"query": " ", "positive": "p"}], 2, "query"),
        ([{"query": "q", "positive": ""}], 1, "positive"),
        ([{"query": "q", "positive": "p", "negatives": ["n", ""]}], 1, "negatives[1]"),
        (
            [
                {"corpus_id": "d1", "text": "doc"},
                {"query_id": "q1", "text": "q"},
                {"query_id": "q1", "corpus_id": "d9"},
            ],
            3,
            "corpus_id",
        ),
        ([{"corpus_id": "d1", "text": "doc"}, {"query_id": "q7", "corpus_id": "d1"}], 2, "query_id"),
        ([{"corpus_id": "d1", "text": ""}], 1, "text"),
    ]
    for rows, line, field in cases:
        with pytest.raises(DatasetError) as err:
            parse_dataset(jsonl(rows))
        assert (err.value.line, err.value.field) == (line, field), str(err.value)
        assert f"line {line}" in str(err.value)


def test_beir_rows_become_pairs_and_a_corpus_and_title_pairs_skip_shared_headings() -> None:
    rows = [
        {"corpus_id": "d1", "title": "Cats", "text": "Cats purr."},
        {"corpus_id": 2, "text": "Dogs bark."},
        {"query_id": "q1", "text": "do cats purr"},
        {"query_id": "q1", "corpus_id": "d1", "score": 1},
        {"query_id": "q1", "corpus_id": "2", "score": 0},
    ]
    data = embedder_data(parse_dataset(jsonl(rows)).records)
    assert [(p["query"], p["positive"]) for p in data.pairs] == [("do cats purr", "Cats\nCats purr.")]
    assert data.corpus == {"d1": "Cats\nCats purr.", "2": "Dogs bark."}
    rs = retrieval_set([], data.pairs, data.corpus)
    assert rs.relevant == {"q0": {"d1"}} and set(rs.corpus) == {"d1", "2"}

    docs = [
        ("Guide", "# Install\nRun the installer.\n# Introduction\nHello."),
        ("", "# Introduction\nAnother intro.\n## Usage\nCall it."),
    ]
    got = {(p["query"], p["positive"]) for p in title_pairs(docs)}
    assert got == {
        ("Guide", "# Install\nRun the installer.\n# Introduction\nHello."),
        ("Install", "Run the installer."),
        ("Usage", "Call it."),
    }  # "Introduction" heads two sections: left out


def test_batches_never_hold_a_text_twice_and_depend_only_on_the_seed() -> None:
    pairs = [{"query": f"q{i % 5}", "positive": f"p{i}"} for i in range(20)]
    batches = batch_schedule(pairs, 4, 2, seed=3)
    assert batches == batch_schedule(pairs, 4, 2, seed=3) != batch_schedule(pairs, 4, 2, seed=4)
    assert sorted(i for b in batches for i in b) == sorted(list(range(20)) * 2)
    for b in batches:
        queries = [pairs[i]["query"] for i in b]
        assert len(queries) == len(set(queries)) and len(b) <= 4


# ---- recipe
def test_training_raises_held_out_ndcg_and_reports_both(tiny_st: Path) -> None:
    hooks = NullHooks()
    recipe = EmbedderRecipe(config(tiny_st, None), hooks=hooks)
    assert run(recipe) == "succeeded"
    m = recipe.last_metrics
    for k in ("ndcg@10", "recall@100", "recall@10", "mrr@10"):
        assert f"eval_{k}_before" in m and f"eval_{k}_after" in m, sorted(m)
    assert m["eval_ndcg@10_after"] > m["eval_ndcg@10_before"] + 0.05, m
    assert set(hooks.evals) == {"before", "after"}
    assert hooks.history[-1]["loss"] < hooks.history[0]["loss"]


@pytest.mark.parametrize("precision", ["auto", "bf16", "fp32"])
def test_precision_sets_the_dtype_of_the_steps_matrix_products(tiny_st: Path, precision: str) -> None:
    """bf16 runs the encoder's products in bf16 while its weights stay fp32; fp32, and auto on
    a CPU, keep them fp32; both train."""
    seen: list[torch.dtype] = []
    recipe = EmbedderRecipe(config(tiny_st, None, precision=precision, max_steps=2))
    recipe.setup()
    first = next(m for m in recipe.model.modules() if isinstance(m, torch.nn.Linear))
    hook = first.register_forward_hook(lambda _m, _inp, out: seen.append(out.dtype))
    metrics = recipe.train_step(1)
    hook.remove()
    bf16 = precision == "bf16"
    assert seen and set(seen) == {torch.bfloat16 if bf16 else torch.float32}
    assert first.weight.dtype == torch.float32 and math.isfinite(metrics["loss"])


def test_cached_loss_with_matryoshka_trains_too(tiny_st: Path) -> None:
    cfg = config(tiny_st, None, loss="cached_mnrl", mini_batch_size=3, matryoshka_dims=[32, 16], max_steps=2)
    recipe = EmbedderRecipe(cfg)
    assert run(recipe) == "succeeded"
    assert recipe.total_steps == 2 and recipe.model.max_seq_length == 256


def test_killed_embedder_run_resumes_to_the_same_final_loss(tiny_st: Path, tmp_path: Path) -> None:
    full = NullHooks()
    assert (
        run(EmbedderRecipe(config(tiny_st, tmp_path / "a"), hooks=full), tmp_path / "a" / "ckpt")
        == "succeeded"
    )
    with pytest.raises(KeyboardInterrupt):
        run(EmbedderRecipe(config(tiny_st, tmp_path / "b"), hooks=KillAt(5)), tmp_path / "b" / "ckpt")
    again = NullHooks()
    assert (
        run(EmbedderRecipe(config(tiny_st, tmp_path / "b"), hooks=again), tmp_path / "b" / "ckpt")
        == "succeeded"
    )
    assert [h["step"] for h in again.history] == list(
        range(5, len(full.history) + 1)
    )  # from step 4's checkpoint
    assert again.history[-1]["loss"] == pytest.approx(full.history[-1]["loss"], abs=1e-5)
    assert again.evals["after"]["eval_ndcg@10_before"] == full.evals["before"]["eval_ndcg@10_before"]


def staged_config(model: Path, work: Path) -> TrainConfig:
    """12 training pairs: the first 6 as a collection's title pairs, the rest labelled."""
    cfg = config(model, work, n_epochs=2, title_epochs=1, batch_size=3, warmup_steps=2)
    cfg.records = [
        {**r, "_stage": TITLE_STAGE if i < 6 else LABELLED_STAGE} for i, r in enumerate(cfg.records[:12])
    ]
    cfg.stages = "titles_first"
    return cfg


def test_titles_first_trains_each_stage_on_its_own_pairs_and_schedule_and_resumes_across(
    tiny_st: Path, tmp_path: Path
) -> None:
    full = NullHooks()
    recipe = EmbedderRecipe(staged_config(tiny_st, tmp_path / "a"), hooks=full)
    assert run(recipe, tmp_path / "a" / "ckpt") == "succeeded"
    # 6 title pairs for 1 epoch (2 batches of 3), then 6 labelled pairs for 2 epochs (4 batches)
    assert recipe.stage_starts == [0, 2] and recipe.total_steps == 6
    stage_of = [{recipe.pairs[i]["_stage"] for i in batch} for batch in recipe.schedule]
    assert stage_of == [{TITLE_STAGE}] * 2 + [{LABELLED_STAGE}] * 4
    lr = recipe.hp.learning_rate
    # each stage warms up again (2 steps), then decays linearly over its own steps
    assert [round(h["learning_rate"] / lr, 4) for h in full.history] == [0.5, 1.0, 0.5, 1.0, 1.0, 0.5]
    # killed in the second stage (after step 4's checkpoint), resumed: the same end
    with pytest.raises(KeyboardInterrupt):
        run(EmbedderRecipe(staged_config(tiny_st, tmp_path / "b"), hooks=KillAt(5)), tmp_path / "b" / "ckpt")
    again = NullHooks()
    assert run(
        EmbedderRecipe(staged_config(tiny_st, tmp_path / "b"), hooks=again), tmp_path / "b" / "ckpt"
    ) == ("succeeded")
    assert [h["step"] for h in again.history] == [5, 6]
    assert again.history[-1]["loss"] == pytest.approx(full.history[-1]["loss"], abs=1e-5)


def test_embedder_cancel_stops_within_one_step(tiny_st: Path) -> None:
    hooks = CancelAfter(2)
    assert run(EmbedderRecipe(config(tiny_st, None), hooks=hooks)) == "cancelled"
    assert [h["step"] for h in hooks.history] == [1, 2]


# ---- through the API
@pytest.fixture()
def harness(tandem_env: Path, tiny_st: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    with serving(tiny_st, tandem_env, monkeypatch) as h:
        yield h


def post_job(h: Harness, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{h.base}/v1/jobs", json=body, headers=auth(key), timeout=60)


def test_embedder_job_publishes_for_its_tenant_only(
    harness: Harness, api_key: str, other_key: str, tiny_st: Path, tandem_env: Path
) -> None:
    up = upload(harness, api_key, jsonl(PAIRS))
    assert up.status_code == 201 and up.json()["format"] == "pairs" and up.json()["kinds"] == ["embedder"]
    fid = up.json()["id"]
    bad = upload(harness, api_key, jsonl([{"query": "q", "positive": "p"}, {"query": "q2", "positive": " "}]))
    assert bad.status_code == 400 and "line 2" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "positive"
    body = {"type": "embedder", "base_model": str(tiny_st), "dataset": fid, "eval_fraction": 0.25}
    for extra, needle, param in [
        ({"resources": {"procs_per_node": 2}}, "embedder jobs run in one process", "resources"),
        ({"lora": {"r": 4}}, "'lora' does not apply to embedder jobs", None),
        ({"hyperparameters": {"matryoshka_dims": [64]}}, "more than the model's 32 dimensions", None),
        ({"base_model": "ft-emb-0123"}, "no such embedder among yours", "base_model"),
        ({"dataset": None}, "needs 'dataset'", None),
    ]:
        resp = post_job(harness, api_key, {**body, **extra})
        assert resp.status_code in (400, 404), (needle, resp.text)
        assert needle in resp.json()["error"]["message"], (needle, resp.json())
        if param:
            assert resp.json()["error"]["param"] == param
    knob = post_job(harness, api_key, {**body, "type": "sft", "hyperparameters": {"loss": "cached_mnrl"}})
    assert knob.status_code == 400 and "only applies to embedder jobs" in knob.json()["error"]["message"]
    sft = post_job(harness, api_key, {**body, "type": "sft", "base_model": "x"})
    assert sft.status_code == 400 and "suits embedder jobs, not sft" in sft.json()["error"]["message"]
    assert harness.dispatched == []

    hp = {"learning_rate": 1e-3, "n_epochs": 4, "batch_size": 8, "seed": 1}
    created = post_job(harness, api_key, {**body, "publish": True, "hyperparameters": hp})
    assert created.status_code == 201, created.text
    jid = created.json()["id"]
    assert harness.run_worker(jid) == "succeeded"
    job = httpx.get(f"{harness.base}/v1/jobs/{jid}", headers=auth(api_key)).json()
    name = embedder_name(jid)
    assert job["fine_tuned_model"] == name and job["published"] is True
    assert job["progress"]["step"] == job["progress"]["total"] > 0
    m = job["metrics"]
    assert m["eval_ndcg@10_after"] > m["eval_ndcg@10_before"] and "eval_recall@100_after" in m
    hit = find_embedder(tandem_env, "acme", name)
    assert hit is not None
    folder, manifest = hit
    assert manifest.dim == 32 and manifest.tenant == "acme" and (folder / "modules.json").is_file()
    assert manifest.metrics["ndcg@10"] == pytest.approx(m["eval_ndcg@10_after"], abs=1e-5)
    assert manifest.metrics["ndcg@10_before"] == pytest.approx(m["eval_ndcg@10_before"], abs=1e-5)
    assert find_embedder(tandem_env, "globex", name) is None and list_embedders(tandem_env, "globex") == []
    # the tenant trains its embedder further; another tenant cannot start from it
    again = {**body, "base_model": name, "hyperparameters": {"max_steps": 1}}
    assert post_job(harness, api_key, again).status_code == 201
    other_fid = upload(harness, other_key, jsonl(PAIRS)).json()["id"]
    theirs = post_job(harness, other_key, {**again, "dataset": other_fid})
    assert theirs.status_code == 404 and theirs.json()["error"]["param"] == "base_model"
    by_path = post_job(harness, other_key, {**again, "dataset": other_fid, "base_model": str(folder)})
    assert by_path.status_code == 404, by_path.text


def test_a_collection_trains_without_labels_and_another_tenants_is_not_found(
    harness: Harness,
    api_key: str,
    other_key: str,
    tiny_st: Path,
    tandem_env: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.retrieval.app import create_app as retrieval_app

    monkeypatch.setenv("TANDEM_RETRIEVAL_EMBEDDING_MODEL", str(tiny_st))
    with serve_app(retrieval_app()) as retrieval:
        harness.st.common = harness.st.common.model_copy(update={"retrieval_url": retrieval})
        with httpx.Client(base_url=retrieval, headers=auth(api_key), timeout=60) as rc:
            assert rc.post("/v1/collections", json={"name": "kb"}).status_code == 201
            docs = [
                {"id": f"d{i}", "title": f"All about the {t}", "text": f"The {t} has many properties. " * 3}
                for i, t in enumerate(TOPICS.split())
            ]
            assert rc.post("/v1/collections/kb/documents", json={"documents": docs}).status_code == 201
        body = {
            "type": "embedder",
            "base_model": str(tiny_st),
            "collection": "kb",
            "eval_fraction": 0.25,
            "hyperparameters": {"learning_rate": 1e-3, "n_epochs": 2, "batch_size": 4},
        }
        theirs = post_job(harness, other_key, body)
        assert theirs.status_code == 404 and theirs.json()["error"]["param"] == "collection", theirs.text
        created = post_job(harness, api_key, body)
        assert created.status_code == 201, created.text
    job = created.json()
    assert job["collection"] == "kb" and job["dataset"].startswith("file-")
    snapshot = httpx.get(f"{harness.base}/v1/files/{job['dataset']}", headers=auth(api_key)).json()
    assert snapshot["rows"] == len(docs) and snapshot["format"] == "pairs"
    # trained from the snapshot: the retrieval service is gone by now
    assert harness.run_worker(job["id"]) == "succeeded"
    done = httpx.get(f"{harness.base}/v1/jobs/{job['id']}", headers=auth(api_key)).json()
    assert "eval_ndcg@10_after" in done["metrics"] and done["fine_tuned_model"] is None


def test_a_retrieval_refusal_keeps_its_status_and_an_unreachable_one_names_the_collection(
    harness: Harness, api_key: str, tiny_st: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer reads a collection with the shared upstream mapping: the retrieval service's
    429 (the tenant's rate limit, one request a minute) reaches the caller as a 429 with its
    Retry-After, not a 503, and a retrieval service that is down is a 503 naming ``collection``."""
    from services.retrieval.app import create_app as retrieval_app

    monkeypatch.setenv("TANDEM_RETRIEVAL_EMBEDDING_MODEL", str(tiny_st))
    monkeypatch.setenv("TANDEM_RETRIEVAL_TENANT_REQUESTS_PER_MINUTE", "1")
    monkeypatch.setenv("TANDEM_RETRIEVAL_TENANT_BURST", "1")
    body = {"type": "embedder", "base_model": str(tiny_st), "collection": "kb", "eval_fraction": 0.25}
    with serve_app(retrieval_app()) as retrieval:
        harness.st.common = harness.st.common.model_copy(update={"retrieval_url": retrieval})
        # the tenant's one request of the minute: the trainer's read, with the same key, is over it
        assert httpx.get(f"{retrieval}/v1/whoami", headers=auth(api_key)).status_code == 200
        limited = post_job(harness, api_key, body)
    assert limited.status_code == 429, limited.text
    assert 1 <= int(limited.headers["Retry-After"]) <= 60
    assert "retrieval" in limited.json()["error"]["message"]
    harness.st.common = harness.st.common.model_copy(
        update={"retrieval_url": f"http://127.0.0.1:{free_port()}"}
    )
    down = post_job(harness, api_key, body)
    assert down.status_code == 503 and down.json()["error"]["param"] == "collection", down.text


@pytest.mark.e2e
def test_embedder_job_through_a_real_worker_publishes(
    tandem_env: Path, tiny_st: Path, api_key: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tests.trainer.test_e2e import create_job, finished_job, worker_env

    monkeypatch.setenv("TANDEM_MODEL_ROOTS", f"{tiny_st.parent}:{tandem_env / 'models'}")
    log = tmp_path / "worker.log"
    app = create_app(CommonSettings(), TrainerSettings())
    rows = [{"corpus_id": f"d{i}", "text": p["positive"]} for i, p in enumerate(PAIRS)]
    rows += [{"query_id": f"q{i}", "text": p["query"]} for i, p in enumerate(PAIRS)]
    rows += [{"query_id": f"q{i}", "corpus_id": f"d{i}"} for i in range(len(PAIRS))]
    with serve_app(app) as base, celery_worker(worker_env({}), log, "w1"):
        up = httpx.post(
            f"{base}/v1/files", files={"file": ("beir.jsonl", jsonl(rows))}, headers=auth(api_key)
        )
        assert up.status_code == 201 and up.json()["format"] == "beir", up.text
        body = {
            "type": "embedder",
            "base_model": str(tiny_st),
            "dataset": up.json()["id"],
            "eval_fraction": 0.25,
            "publish": True,
            "hyperparameters": {"learning_rate": 1e-3, "n_epochs": 4, "batch_size": 8, "seed": 1},
        }
        jid = create_job(base, api_key, body)
        done = finished_job(base, api_key, jid, log)
    assert done["status"] == "succeeded", done["error"]
    assert done["fine_tuned_model"] == embedder_name(jid)
    hit = find_embedder(tandem_env, "acme", embedder_name(jid))
    assert hit is not None and json.loads((hit[0] / "tandem_training.json").read_text())["dim"] == 32
    assert done["metrics"]["eval_ndcg@10_after"] > done["metrics"]["eval_ndcg@10_before"]


def test_eval_retrieval_compares_embedders(
    tiny_st: Path, tandem_env: Path, api_key: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``tandem eval retrieval --embedder A --embedder B``: one collection per embedder, the
    same queries through each, the figures of both (a fine-tune ranks its queries better)."""
    from typer.testing import CliRunner

    from services.cli.main import app as cli
    from services.retrieval.app import create_app as retrieval_app

    models = tandem_env / "models"
    trained = models / "tiny-trained"
    recipe = EmbedderRecipe(config(tiny_st, None))
    assert run(recipe) == "succeeded"
    recipe.save_final(trained)
    beir = tmp_path / "tinyset"
    (beir / "qrels").mkdir(parents=True)
    (beir / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": f"d{i}", "text": p["positive"]}) + "\n" for i, p in enumerate(PAIRS))
    )
    (beir / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": f"q{i}", "text": p["query"]}) + "\n" for i, p in enumerate(PAIRS))
    )
    (beir / "qrels" / "test.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(len(PAIRS)))
    )
    monkeypatch.setenv("TANDEM_MODEL_ROOTS", f"{tiny_st.parent}:{models}")
    monkeypatch.setenv("TANDEM_RETRIEVAL_EMBEDDING_MODEL", str(tiny_st))
    out = tmp_path / "figures.json"
    with serve_app(retrieval_app()) as url:
        args = [
            "eval",
            "retrieval",
            "--beir",
            str(beir),
            "--mode",
            "dense",
            "--url",
            url,
            "--api-key",
            api_key,
        ]
        args += ["--embedder", str(tiny_st), "--embedder", str(trained), "--json", str(out)]
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        names = {
            c["name"] for c in httpx.get(f"{url}/v1/collections", headers=auth(api_key)).json()["collections"]
        }
    assert names == {"beir-tinyset-tiny-embedder", "beir-tinyset-tiny-trained"}
    figures = {f["embedder"]: f for f in json.loads(out.read_text())}
    assert set(figures) == {str(tiny_st), str(trained)}
    assert all(f["queries"] == len(PAIRS) for f in figures.values())
    assert figures[str(trained)]["ndcg10"] > figures[str(tiny_st)]["ndcg10"]
