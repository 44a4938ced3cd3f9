"""Durability: kill -9 of a real service process during a large ingestion, then restart;
torn or stale index checkpoints; concurrent writers into one collection."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from services.retrieval.config import RetrievalSettings
from services.retrieval.core.collection import InputDocument
from services.retrieval.core.registry import CollectionManager
from tests.conftest import REPO_ROOT, auth
from tests.helpers.servers import free_port, stop_process, wait_ready
from tests.helpers.waiting import wait_until


def start_service(env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "services.retrieval.app:create_app",
            "--factory",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",
        ],
        cwd=REPO_ROOT,
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )


def doc(i: int, version: int = 0) -> dict[str, object]:
    # A unique marker word per document (and version) to find it by sparse search.
    words = " ".join(f"filler{(i * 7 + k) % 50}" for k in range(60))
    return {
        "id": f"doc-{i}",
        "text": f"marker{i}x{version} {words}. Closing sentence {i}.",
        "metadata": {"i": i},
    }


@pytest.mark.e2e
def test_kill_9_during_ingestion_then_restart(
    retrieval_env: Path, api_key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {k: v for k, v in os.environ.items()}
    env["TANDEM_RETRIEVAL_CHECKPOINT_EVERY"] = "40"  # checkpoints happen during the run too
    # This test reads every acknowledged document back, hundreds of requests in a few seconds:
    # the per-tenant rate limit (tested in test_tenant_limits.py) is not what it is about.
    env["TANDEM_RETRIEVAL_TENANT_REQUESTS_PER_MINUTE"] = "0"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "service.log"
    proc = start_service(env, port, log)
    acked: dict[str, str] = {}  # doc id -> text the service acknowledged last
    try:
        wait_ready(url, proc)
        h = auth(api_key)
        assert (
            httpx.post(
                f"{url}/v1/collections",
                json={"name": "big", "chunking": {"size": 32, "overlap": 4}},
                headers=h,
            ).status_code
            == 201
        )
        stop = threading.Event()
        errors: list[str] = []

        def writer() -> None:
            i = 0
            with httpx.Client(base_url=url, headers=h, timeout=30) as c:
                while not stop.is_set():
                    batch = [doc(n) for n in range(i, i + 10)]
                    if i >= 20:  # also replace earlier documents with a new version
                        batch.append(doc(i - 20, version=1))
                    try:
                        r = c.post("/v1/collections/big/documents", json={"documents": batch})
                    except httpx.HTTPError:
                        return  # the kill: this request was never acknowledged
                    if r.status_code != 201:
                        errors.append(r.text)
                        return
                    for d in batch:
                        acked[str(d["id"])] = str(d["text"])
                    i += 10

        t = threading.Thread(target=writer)
        t.start()
        wait_until(lambda: len(acked) >= 150 or errors, 60, "150 documents acknowledged")
        os.kill(proc.pid, signal.SIGKILL)  # mid-request, most likely mid-write
        proc.wait(10)
        stop.set()
        t.join(30)
        assert not errors, errors
        assert len(acked) >= 150, f"only {len(acked)} documents acknowledged before the kill"

        proc = start_service(env, port, log)
        wait_ready(url, proc)
        with httpx.Client(base_url=url, headers=h, timeout=60) as c:
            info = c.get("/v1/collections/big").json()
            assert info["documents"] >= len(acked)
            # no half-indexed state and no duplicates: every stored chunk is indexed once
            assert info["indexed"] == {"dense": info["chunks"], "sparse": info["chunks"]}
            total_chunks = 0
            offset: int | None = 0
            ids: list[str] = []
            while offset is not None:
                page = c.get("/v1/collections/big/documents", params={"limit": 500, "offset": offset}).json()
                ids += [d["id"] for d in page["documents"]]
                total_chunks += sum(d["chunks"] for d in page["documents"])
                offset = page["next_offset"]
            assert len(ids) == len(set(ids)) == info["documents"]
            assert total_chunks == info["chunks"]
            stored: dict[str, str] = {}
            for doc_id, text in acked.items():
                got = c.get(f"/v1/collections/big/documents/{doc_id}")
                assert got.status_code == 200, doc_id
                stored[doc_id] = got.json()["text"]
                # the acknowledged version, or a newer one whose request was in flight at the kill
                newer = stored[doc_id].startswith(f"marker{doc_id.split('-')[1]}x1")
                assert stored[doc_id] == text or newer, doc_id
            for doc_id in list(acked)[::7]:
                # the stored version's marker: a replacement in flight at the kill may have landed
                marker = stored[doc_id].split()[0]
                found = c.post(
                    "/v1/collections/big/search", json={"query": marker, "mode": "sparse", "top_k": 5}
                )
                assert found.status_code == 200, found.text
                hits = found.json()["results"]
                assert hits and hits[0]["document_id"] == doc_id, (doc_id, hits[:1])
            for mode in ("dense", "hybrid"):
                r = c.post(
                    "/v1/collections/big/search",
                    json={"query": "closing sentence", "mode": mode, "top_k": 50},
                )
                hits = r.json()["results"]
                assert r.status_code == 200 and len(hits) == 50
                assert len({x["chunk_id"] for x in hits}) == 50
            # and the collection keeps taking writes after recovery
            assert (
                c.post("/v1/collections/big/documents", json={"documents": [doc(10_000)]}).status_code == 201
            )
    finally:
        stop_process(proc, 20)


def _manager(home: Path, tiny: Path, **kw: object) -> CollectionManager:
    settings = RetrievalSettings(embedding_model=str(tiny), **kw)  # type: ignore[arg-type]
    return CollectionManager(home, settings, [tiny.parent])


def _docs(n: int, start: int = 0) -> list[InputDocument]:
    return [
        InputDocument(f"d{i}", f"unique{i} text about topic {i % 5}", "", {}) for i in range(start, start + n)
    ]


def test_torn_or_stale_checkpoints_are_repaired(tmp_path: Path, tiny_embedder: Path) -> None:
    m = _manager(tmp_path, tiny_embedder, checkpoint_every=1_000_000)
    m.create("t", "c")
    col = m.get("t", "c")
    col.ingest(_docs(30))
    col.checkpoint()
    col.ingest(_docs(10, start=30))  # logged after the checkpoint: replayed on open
    col.delete_document("d3")
    m.close_all.__self__._open.clear()  # simulate a crash: no checkpoint on close
    col.store.close()

    col = _manager(tmp_path, tiny_embedder).get("t", "c")
    assert col.stats()["indexed"] == {"dense": 39, "sparse": 39}
    assert col.search("unique35", mode="sparse")[0].document_id == "d35"
    assert all(h.document_id != "d3" for h in col.search("unique3", mode="sparse", top_k=50))
    col.checkpoint()
    col.close(checkpoint=False)

    # a torn index file (e.g. a disk that lied): the checksum catches it, the store rebuilds it
    index_dir = tmp_path / "retrieval" / "t" / "c" / "index"
    dense = next(index_dir.glob("dense-*.npz"))
    dense.write_bytes(dense.read_bytes()[:100])
    col = _manager(tmp_path, tiny_embedder).get("t", "c")
    assert col.stats()["indexed"] == {"dense": 39, "sparse": 39}
    assert col.search("unique12", mode="dense", top_k=39)
    col.close(checkpoint=False)
    # a missing manifest: full rebuild from SQLite
    (index_dir / "checkpoint.json").unlink()
    col = _manager(tmp_path, tiny_embedder).get("t", "c")
    assert col.stats()["indexed"] == {"dense": 39, "sparse": 39}
    # leftover temp files from a crash mid-write are ignored
    (index_dir / ".dense-99.npz.abc.tmp").write_bytes(b"partial")
    col.close()
    col = _manager(tmp_path, tiny_embedder).get("t", "c")
    assert col.search("unique20", mode="sparse")[0].document_id == "d20"
    col.close()


def test_concurrent_ingestion_into_one_collection(tmp_path: Path, tiny_embedder: Path) -> None:
    m = _manager(tmp_path, tiny_embedder)
    m.create("t", "c")
    col = m.get("t", "c")
    # a second, independent handle on the same files stands in for another process (the worker)
    other = _manager(tmp_path, tiny_embedder).get("t", "c")
    errors: list[BaseException] = []

    def run(target, start: int) -> None:  # type: ignore[no-untyped-def]
        try:
            for k in range(5):
                # overlapping ids: writers replace each other's documents
                target.ingest(
                    [
                        InputDocument(f"d{(start + k * 7 + j) % 40}", f"w{start} v{k} item {j}", "", {})
                        for j in range(8)
                    ]
                )
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(c, s)) for c, s in [(col, 0), (col, 3), (other, 5), (other, 11)]
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for handle in (col, other):
        stats = handle.stats()
        assert stats["documents"] == len(handle.list_documents(1000, 0)[0])
        assert stats["indexed"] == {"dense": stats["chunks"], "sparse": stats["chunks"]}
        hits = handle.search("item", mode="hybrid", top_k=100)
        assert len({h.chunk_id for h in hits}) == len(hits)
        assert len({h.document_id for h in hits}) == len(hits)  # one chunk per document here
    other.close(checkpoint=False)
    m.close_all()
