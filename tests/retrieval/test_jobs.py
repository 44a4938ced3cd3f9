"""Ingestion jobs: large uploads and many documents become jobs on the io queue; state and
progress in Redis; GET /v1/jobs/{id} and its SSE stream; tenant isolation of jobs."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from services.retrieval.core.jobs import JobStore
from services.retrieval.ingest import run_job
from tests.conftest import auth
from tests.helpers.servers import celery_worker, serve_app
from tests.helpers.sse import named_events
from tests.helpers.waiting import wait_until


@pytest.fixture()
def job_service(retrieval_env: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, object]]:
    monkeypatch.setenv("TANDEM_RETRIEVAL_ASYNC_DOCUMENTS", "5")
    monkeypatch.setenv("TANDEM_RETRIEVAL_ASYNC_UPLOAD_KB", "1")
    from services.retrieval.app import create_app

    app = create_app()
    with serve_app(app) as url:
        yield url, app


def sse_events(client: httpx.Client, path: str) -> list[tuple[str, dict]]:
    with client.stream("GET", path, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return named_events(r.iter_lines(), until=("done", "failed"))


def test_many_documents_become_a_job(
    job_service: tuple[str, object], api_key: str, other_key: str, redis_url: str
) -> None:
    url, app = job_service
    with httpx.Client(base_url=url, headers=auth(api_key), timeout=60) as c:
        assert c.post("/v1/collections", json={"name": "kb"}).status_code == 201
        docs = [{"id": f"d{i}", "text": f"document {i} about subject{i}"} for i in range(12)]
        r = c.post("/v1/collections/kb/documents", json={"documents": docs})
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        assert r.json()["status_url"] == f"/v1/jobs/{job_id}"
        job = c.get(f"/v1/jobs/{job_id}").json()
        assert job["state"] == "queued" and job["documents_total"] == 12
        # another tenant cannot see the job
        assert httpx.get(f"{url}/v1/jobs/{job_id}", headers=auth(other_key)).status_code == 404
        assert c.get("/v1/jobs/job_nope").status_code == 404
        # run the task body here (the Celery worker is exercised in the e2e test below)
        jobs = JobStore(redis.Redis.from_url(redis_url, decode_responses=True))
        result = run_job(app.state.collections, jobs, "acme", "kb", job_id)  # type: ignore[attr-defined]
        assert result["documents"] == 12
        job = c.get(f"/v1/jobs/{job_id}").json()
        assert job["state"] == "succeeded" and job["chunks_done"] == job["chunks_total"] == 12
        events = sse_events(c, f"/v1/jobs/{job_id}/events")
        assert events[-1][0] == "done" and events[-1][1]["chunks_done"] == 12
        hits = c.post("/v1/collections/kb/search", json={"query": "subject7", "mode": "sparse"}).json()[
            "results"
        ]
        assert hits[0]["document_id"] == "d7"


def test_large_upload_becomes_a_job_and_small_bad_file_is_still_rejected_at_once(
    job_service: tuple[str, object], api_key: str
) -> None:
    url, _ = job_service
    with httpx.Client(base_url=url, headers=auth(api_key), timeout=60) as c:
        assert c.post("/v1/collections", json={"name": "kb"}).status_code == 201
        big = ("Paragraph about ocean currents. " * 100).encode()  # > 1 KiB
        r = c.post("/v1/collections/kb/files", files={"file": ("ocean.txt", big)})
        assert r.status_code == 202 and r.json()["job_id"], r.text
        # a small bad file is refused at once
        r = c.post("/v1/collections/kb/files", files={"file": ("latin1.txt", "caf\u00e9".encode("latin-1"))})
        assert r.status_code == 400 and "latin1.txt" in r.json()["error"]["message"]
        # a large one, or a PDF, is parsed only by the worker: its problem is a per-file error in the job
        r = c.post("/v1/collections/kb/files", files={"file": ("broken.pdf", b"%PDF-1.4 garbage" * 200)})
        assert r.status_code == 202 and r.json()["job_id"], r.text


@pytest.mark.e2e
def test_celery_worker_runs_jobs_with_progress(
    job_service: tuple[str, object], api_key: str, tmp_path: Path
) -> None:
    url, _ = job_service
    log = tmp_path / "worker.log"
    worker = celery_worker(
        dict(os.environ),
        log,
        f"io-test-{os.getpid()}",
        "services.retrieval.worker:celery_app",
        "io",
        ("--pool", "threads", "--concurrency", "2"),
    )
    with worker, httpx.Client(base_url=url, headers=auth(api_key), timeout=60) as c:
        assert (
            c.post("/v1/collections", json={"name": "kb", "chunking": {"size": 32, "overlap": 4}}).status_code
            == 201
        )
        lines = [
            json.dumps({"id": f"p{i}", "text": f"passage {i} " + "lorem ipsum dolor sit amet " * 20})
            for i in range(60)
        ]
        r = c.post("/v1/collections/kb/files", files={"file": ("set.jsonl", "\n".join(lines).encode())})
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        events = sse_events(c, f"/v1/jobs/{job_id}/events")
        kinds = [e[0] for e in events]
        assert kinds[-1] == "done", (events[-1], (tmp_path / "worker.log").read_text()[-3000:])
        final = events[-1][1]
        assert final["documents_done"] == 60 and final["chunks_done"] == final["chunks_total"] > 60
        # progress never goes backwards
        done = [e[1]["chunks_done"] for e in events]
        assert done == sorted(done)
        # the API process sees the worker's writes (via the shared SQLite log)
        info = c.get("/v1/collections/kb").json()
        assert info["documents"] == 60 and info["indexed"]["dense"] == info["chunks"]
        hits = c.post("/v1/collections/kb/search", json={"query": "passage 42", "mode": "hybrid"}).json()[
            "results"
        ]
        assert "p42" in [h["document_id"] for h in hits]
        # the job input file is removed after success
        assert not list(
            (Path(os.environ["TANDEM_HOME"]) / "retrieval" / "acme" / "kb" / "uploads").glob("*.jsonl")
        )
        # PDF and DOCX: parsed by the real worker in its sandboxed child; a broken file is a
        # per-file error and the good one is searchable
        from tests.retrieval.test_files import make_docx, make_pdf

        r = c.post(
            "/v1/collections/kb/files",
            files=[
                ("file", ("paper.pdf", make_pdf(["Mitochondria produce ATP for the cell."]))),
                ("file", ("guide.docx", make_docx())),
                ("file", ("broken.docx", b"PK\x03\x04 not a zip")),
            ],
        )
        assert r.status_code == 202, r.text
        events = sse_events(c, f"/v1/jobs/{r.json()['job_id']}/events")
        final = events[-1][1]
        assert events[-1][0] == "done", (final, (tmp_path / "worker.log").read_text()[-3000:])
        assert [e["filename"] for e in final["file_errors"]] == ["broken.docx"]
        assert final["documents_done"] == 2
        assert c.get("/v1/collections/kb/documents/guide.docx").json()["title"] == "Field Guide"


def test_readiness_waits_for_the_embedder(
    retrieval_env: Path, api_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not ready, saying the embedder is loading, for as long as the load takes (held here
    until the test has looked); ready once it is loaded."""
    from services.retrieval.app import create_app
    from services.retrieval.core.registry import CollectionManager

    release = threading.Event()
    real = CollectionManager.embedder_named

    def held(self: CollectionManager, *args: Any, **kwargs: Any) -> Any:
        assert release.wait(60), "the test never released the load"
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CollectionManager, "embedder_named", held)
    with serve_app(create_app()) as url:
        loading = httpx.get(f"{url}/readyz", headers=auth(api_key))
        anonymous = httpx.get(f"{url}/readyz")
        release.set()
        ready = wait_until(lambda: (r := httpx.get(f"{url}/readyz")).status_code == 200 and r, 60, "ready")
    assert loading.status_code == 503 and loading.json()["status"] == "not_ready"
    assert loading.json()["checks"]["embedder"] == "RuntimeError: embedding model is loading"
    # without a key the reason is hidden, the state is not
    assert anonymous.status_code == 503 and anonymous.json()["checks"]["embedder"] == "failing"
    assert ready.json()["checks"]["embedder"] == "ok"


def test_readiness_reports_a_broken_model(
    retrieval_env: Path, api_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model that cannot load leaves the service not ready for good, saying why."""
    monkeypatch.setenv("TANDEM_RETRIEVAL_EMBEDDING_MODEL", "/nonexistent/model")
    from services.retrieval.app import create_app

    def failed() -> httpx.Response | None:
        r = httpx.get(f"{url}/readyz", headers=auth(api_key))
        return r if "failed to load" in r.json()["checks"]["embedder"] else None

    with serve_app(create_app()) as url:
        r = wait_until(failed, 60, "the embedder's load fails")
    assert r.status_code == 503 and "/nonexistent/model" in r.json()["checks"]["embedder"]
