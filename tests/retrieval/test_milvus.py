"""The Milvus backend as a deployment: two retrieval processes over one Milvus Lite server
serve the same collections (each with its own TANDEM_HOME: nothing shared on disk), and bad
configuration stops start-up with a message naming the setting."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from services.common.config import SettingsError
from services.retrieval.config import RetrievalSettings
from services.retrieval.core.collection import InputDocument
from services.retrieval.core.registry import CollectionManager
from services.retrieval.milvus import lite
from tests.conftest import REPO_ROOT, auth
from tests.helpers.servers import celery_worker, free_port, serve_app
from tests.helpers.waiting import wait_until
from tests.retrieval.conftest import IO_WORKER, ONE_THREAD
from tests.retrieval.test_durability import start_service, wait_ready


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()}
    env["TANDEM_HOME"] = str(home)
    env.update(extra)
    return env


def test_two_processes_serve_one_milvus(
    retrieval_env: Path, milvus_uri: str, api_key: str, tmp_path: Path
) -> None:
    procs, urls = [], []
    try:
        for name in ("a", "b"):
            home = tmp_path / name
            home.mkdir()
            port = free_port()
            env = _env(home, TANDEM_RETRIEVAL_BACKEND="milvus", TANDEM_RETRIEVAL_MILVUS_URI=milvus_uri)
            procs.append(start_service(env, port, tmp_path / f"{name}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs, strict=True):
            wait_ready(url, proc)
        h = auth(api_key)
        with (
            httpx.Client(base_url=urls[0], headers=h, timeout=60) as a,
            httpx.Client(base_url=urls[1], headers=h, timeout=60) as b,
        ):
            assert a.post("/v1/collections", json={"name": "shared"}).status_code == 201
            assert b.post("/v1/collections", json={"name": "shared"}).status_code == 409  # B sees it
            docs = [{"id": "moon", "text": "The moon orbits the earth every month.", "metadata": {"k": 1}}]
            assert a.post("/v1/collections/shared/documents", json={"documents": docs}).status_code == 201
            for mode in ("dense", "sparse", "hybrid"):
                r = b.post("/v1/collections/shared/search", json={"query": "moon orbits", "mode": mode})
                assert r.status_code == 200, r.text
                assert r.json()["results"][0]["document_id"] == "moon", (mode, r.json())
            assert b.get("/v1/collections/shared").json()["documents"] == 1
            assert b.get("/v1/collections/shared/documents/moon").json()["text"] == docs[0]["text"]
            # B deletes; A sees it at once (Strong consistency, no local state)
            assert b.delete("/v1/collections/shared/documents/moon").status_code == 204
            r = a.post("/v1/collections/shared/search", json={"query": "moon orbits", "mode": "sparse"})
            assert r.json()["results"] == []
            assert b.delete("/v1/collections/shared").status_code == 204
            assert a.get("/v1/collections/shared").status_code == 404
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)


@pytest.mark.e2e
def test_ingestion_jobs_run_on_an_io_worker_over_milvus(
    retrieval_env: Path, milvus_uri: str, api_key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many documents become a job, which the io worker (a Celery process, as compose's
    ``scale`` profile runs beside the replicas) writes to Milvus with the same backend settings;
    the API finds them. A worker left on the embedded backend fails the job naming the setting."""
    from services.retrieval.app import create_app

    for k, v in {
        "TANDEM_RETRIEVAL_BACKEND": "milvus",
        "TANDEM_RETRIEVAL_MILVUS_URI": milvus_uri,
        "TANDEM_RETRIEVAL_ASYNC_DOCUMENTS": "5",
    }.items():
        monkeypatch.setenv(k, v)
    name = f"jobs-{os.getpid()}"
    docs = [{"id": f"d{i}", "text": f"document {i} about subject{i}"} for i in range(12)]
    log = tmp_path / "worker.log"

    def finished(c: httpx.Client, job_id: str) -> dict:
        job: dict = wait_until(
            lambda: (j := c.get(f"/v1/jobs/{job_id}").json())["status"] in ("succeeded", "failed") and j,
            300,
            "the ingestion job",
            log=log,
        )
        return job

    with (
        serve_app(create_app()) as url,
        httpx.Client(base_url=url, headers=auth(api_key), timeout=60) as c,
    ):
        assert c.post("/v1/collections", json={"name": name}).status_code == 201
        try:
            with celery_worker(
                dict(os.environ), log, f"io-milvus-{os.getpid()}", IO_WORKER, "io", ONE_THREAD
            ):
                r = c.post(f"/v1/collections/{name}/documents", json={"documents": docs})
                assert r.status_code == 202, r.text
                job = finished(c, r.json()["job_id"])
                assert job["status"] == "succeeded", (job, log.read_text()[-3000:])
            assert c.get(f"/v1/collections/{name}").json()["documents"] == 12
            for mode in ("dense", "sparse", "hybrid"):
                hits = c.post(
                    f"/v1/collections/{name}/search", json={"query": "subject7", "mode": mode}
                ).json()
                assert "d7" in [h["document_id"] for h in hits["results"]], (mode, hits)
            # the io worker of the embedded backend over the same home: the job fails, naming why
            embedded = {**os.environ, "TANDEM_RETRIEVAL_BACKEND": "embedded"}
            with celery_worker(embedded, log, f"io-embedded-{os.getpid()}", IO_WORKER, "io", ONE_THREAD):
                r = c.post(f"/v1/collections/{name}/documents", json={"documents": docs[:6]})
                assert r.status_code == 202, r.text
                job = finished(c, r.json()["job_id"])
            assert job["status"] == "failed" and "TANDEM_RETRIEVAL_BACKEND=milvus" in job["error"], job
        finally:
            assert c.delete(f"/v1/collections/{name}").status_code == 204


def test_an_unknown_backend_stops_start_up(retrieval_env: Path, tmp_path: Path) -> None:
    env = _env(retrieval_env, TANDEM_RETRIEVAL_BACKEND="cassandra")
    log = tmp_path / "service.log"
    proc = start_service(env, free_port(), log)
    assert proc.wait(120) != 0
    assert "TANDEM_RETRIEVAL_BACKEND" in log.read_text()


def test_an_unreachable_milvus_stops_start_up(retrieval_env: Path, tiny_embedder: Path) -> None:
    settings = RetrievalSettings(
        embedding_model=str(tiny_embedder),
        backend="milvus",
        milvus_uri=f"http://127.0.0.1:{free_port()}",
        milvus_timeout=2,
    )
    with pytest.raises(SettingsError, match="TANDEM_RETRIEVAL_MILVUS_URI"):
        CollectionManager(retrieval_env, settings, [tiny_embedder.parent])
    settings = settings.model_copy(update={"milvus_uri": "./local.db"})
    with pytest.raises(
        SettingsError, match=re.escape("TANDEM_RETRIEVAL_MILVUS_URI='./local.db' is not a server address")
    ):
        CollectionManager(retrieval_env, settings, [tiny_embedder.parent])


def test_collections_of_one_backend_are_refused_by_the_other(
    tmp_path: Path, tiny_embedder: Path, milvus_uri: str
) -> None:
    embedded = RetrievalSettings(embedding_model=str(tiny_embedder))
    milvus = embedded.model_copy(update={"backend": "milvus", "milvus_uri": milvus_uri})
    roots = [tiny_embedder.parent]
    m = CollectionManager(tmp_path / "one", embedded, roots)
    m.create("t", "notes")
    m.get("t", "notes").ingest([InputDocument("d", "some text")])
    m.close_all()
    with pytest.raises(SettingsError, match=r"TANDEM_RETRIEVAL_BACKEND=milvus, but .* \(t/notes\)"):
        CollectionManager(tmp_path / "one", milvus, roots)

    m = CollectionManager(tmp_path / "two", milvus, roots)
    m.create("t-cross", "notes")
    m.close_all()
    with pytest.raises(SettingsError, match="set TANDEM_RETRIEVAL_BACKEND=milvus"):
        CollectionManager(tmp_path / "two", embedded, roots)
    m = CollectionManager(tmp_path / "two", milvus, roots)
    m.delete("t-cross", "notes")
    m.close_all()


def test_the_lite_launcher_runs_as_a_command(tmp_path: Path) -> None:
    """``python -m services.retrieval.milvus.lite`` (docs/retrieval.md) serves until stopped."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.retrieval.milvus.lite", str(tmp_path / "x.db"), "--port", str(port)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert f"http://127.0.0.1:{port}" in proc.stdout.readline()
        from pymilvus import MilvusClient

        assert MilvusClient(f"http://127.0.0.1:{port}").list_collections() == []
    finally:
        proc.terminate()
        proc.wait(30)
    # the engine went with the launcher (a stale server would hold the port and the data file)
    wait_until(lambda: not lite._listening(port), 30, "Milvus Lite to stop")
