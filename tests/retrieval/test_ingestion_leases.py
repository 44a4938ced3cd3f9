"""Ingestion jobs run under leases: a worker killed mid-job stops renewing its lease and the
job is requeued by another worker's recovery scan (not after the broker's week-long visibility
timeout); a redelivered or duplicated task never runs a job twice at once."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
import redis

from services.retrieval.config import RetrievalSettings
from services.retrieval.core.jobs import JobStore
from services.retrieval.ingest import recover_orphans, run_leased
from tests.conftest import auth
from tests.helpers.servers import celery_worker, serve_app
from tests.helpers.waiting import wait_until
from tests.retrieval.conftest import IO_WORKER, ONE_THREAD, second_worker_finishes


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def running_job(store: JobStore, job_id: str, attempts: int) -> None:
    store.create(job_id, "acme", "kb", documents=1)
    store.update(job_id, status="running", attempts=attempts)


def test_a_job_whose_worker_stopped_renewing_is_requeued_once(redis_client: redis.Redis) -> None:
    clock = Clock()
    store = JobStore(redis_client, clock)
    settings = RetrievalSettings(stale_after_s=0.5, max_recoveries=2)
    job_id = f"job_lease_{os.getpid()}"
    running_job(store, job_id, attempts=1)
    assert store.leases.acquire(job_id, "dead-worker", settings.stale_after_s)
    sent: list[tuple[str, str, str]] = []

    def dispatch(t: str, c: str, j: str) -> None:
        sent.append((t, c, j))

    clock.now += 0.4
    assert recover_orphans(store, settings, dispatch) == []  # the lease is still alive
    clock.now += 0.2
    assert recover_orphans(store, settings, dispatch) == [job_id]
    assert recover_orphans(store, settings, dispatch) == []  # this attempt is requeued once only
    assert sent == [("acme", "kb", job_id)]
    job = store.get(job_id)
    assert job is not None and job.status == "queued"


def test_a_job_lost_too_often_fails_and_leaves_the_active_set(redis_client: redis.Redis) -> None:
    store = JobStore(redis_client, Clock())
    settings = RetrievalSettings(max_recoveries=2)
    job_id = f"job_lost_{os.getpid()}"
    running_job(store, job_id, attempts=3)  # no lease: its worker is gone
    assert recover_orphans(store, settings, lambda *a: None) == []
    job = store.get(job_id)
    assert job is not None and job.status == "failed" and "lost 3 times" in (job.error or "")
    assert job_id not in store.active_jobs()


def test_a_held_or_finished_job_is_not_run_again(redis_client: redis.Redis) -> None:
    store = JobStore(redis_client, Clock())
    settings = RetrievalSettings()
    held, done = f"job_held_{os.getpid()}", f"job_done_{os.getpid()}"
    running_job(store, held, attempts=1)
    assert store.leases.acquire(held, "live-worker", 30)
    # the manager is never reached for either: nothing is ingested
    assert "running elsewhere" in run_leased(None, store, settings, "acme", "kb", held)["skipped"]  # type: ignore[arg-type]
    store.create(done, "acme", "kb")
    store.update(done, status="succeeded")
    assert "succeeded" in run_leased(None, store, settings, "acme", "kb", done)["skipped"]  # type: ignore[arg-type]
    assert done not in store.active_jobs()


@pytest.mark.e2e
@pytest.mark.usefixtures("fast_leases")
def test_an_ingestion_worker_killed_mid_job_is_replaced_and_the_job_ends_once(
    retrieval_env: Path, api_key: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TANDEM_RETRIEVAL_ASYNC_DOCUMENTS", "5")
    from services.retrieval.app import create_app

    log = tmp_path / "workers.log"
    n = 400
    with serve_app(create_app()) as url, httpx.Client(base_url=url, headers=auth(api_key), timeout=60) as c:
        assert (
            c.post("/v1/collections", json={"name": "kb", "chunking": {"size": 32, "overlap": 4}}).status_code
            == 201
        )
        docs = [
            {"id": f"d{i}", "text": f"record {i} zq{i}x " + "lorem ipsum dolor sit amet " * 20}
            for i in range(n)
        ]
        r = c.post("/v1/collections/kb/documents", json={"documents": docs})
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]

        def job() -> dict:
            return dict(c.get(f"/v1/jobs/{job_id}").json())

        with celery_worker(
            dict(os.environ), log, f"first-{os.getpid()}", IO_WORKER, "io", ONE_THREAD
        ) as first:
            wait_until(
                lambda: job()["status"] == "running" and job()["chunks_done"] > 0,
                300,
                "the job under way",
                log=log,
            )
            os.kill(first.pid, signal.SIGKILL)  # mid-job, without acking its message
            first.wait()
        assert job()["status"] == "running"
        final = second_worker_finishes(job, job_id, log)
        info = c.get("/v1/collections/kb").json()
        assert info["documents"] == n and info["chunks"] == final["chunks_total"]  # each chunk once
        hits = c.post(
            "/v1/collections/kb/search", json={"query": "zq123x", "mode": "sparse", "top_k": 5}
        ).json()
        assert [h["document_id"] for h in hits["results"]].count("d123") == 1
