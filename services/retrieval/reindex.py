"""Reindex jobs: a collection switches to another embedder without downtime (issue 17).

``PATCH /v1/collections/{name}`` ``{"embedder"}`` records the version to build in the
collection's store (``begin_build``: one at a time, a second is a 409) and queues a job on the
``io`` queue: the same Celery task and lease as an ingestion job (``ingest.run_leased`` runs
this module's ``run_reindex`` for a job of kind ``reindex``), so a worker killed mid-job is
replaced through the same lease recovery. The job embeds every chunk with the new embedder
into the store's ``staged`` table, in committed batches (a re-run resumes after the last),
while searches answer from the active version; then one transaction (``switch_to``) embeds
the chunks written meanwhile, moves the active vectors aside as the previous version and
the new ones in, and flips the version rows. A crash before that commit leaves the old
version active, after it the new one; a re-run after the flip only marks the job done.
``POST /v1/collections/{name}/rollback`` switches back the same way.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from services.common.errors import Conflict, InvalidRequest, TandemError
from services.common.jobs import TERMINAL
from services.retrieval.core.collection import ChunkedCollection, Collection
from services.retrieval.core.embedder import Embedder
from services.retrieval.core.jobs import Dispatch, JobStore, new_job_id
from services.retrieval.core.onnx_export import EmbeddingBackend
from services.retrieval.core.registry import CollectionManager
from services.retrieval.core.versions import IndexState, IndexVersion, VersionSuperseded
from services.retrieval.gate import GateVerdict, judge
from services.retrieval.job_results import JobFailed, ReindexGated, ReindexResult, ReindexVersions
from services.retrieval.protocol import ReindexGate, ReindexResponse

log = logging.getLogger("tandem.retrieval.reindex")

KIND = "reindex"
# Called with the name of each step of a reindex ("staged" after each batch, "in_switch"
# inside the switch's transaction, "before_switch", "after_switch"): tests crash it there.
Hook = Callable[[str], None]


def embedded(col: ChunkedCollection) -> Collection:
    col.versions()  # 501 on a backend without index versions
    assert isinstance(col, Collection)
    return col


def job_busy(jobs: JobStore) -> Callable[[IndexVersion], bool]:
    """Whether the job building a version still runs (or waits): a failed or vanished one's
    build is abandoned and may be replaced."""

    def busy(v: IndexVersion) -> bool:
        job = jobs.get(v.job_id)
        return job is not None and job.status not in TERMINAL

    return busy


def backend(col: ChunkedCollection) -> EmbeddingBackend:
    """The collection's embedding backend: a new version is embedded as its documents were."""
    return col.config.embedding_backend  # type: ignore[return-value]


def start_reindex(
    manager: CollectionManager,
    jobs: JobStore,
    tenant: str,
    name: str,
    embedder: str,
    dispatch: Dispatch,
    gate: ReindexGate | None = None,
) -> ReindexResponse:
    col = embedded(manager.get(tenant, name))
    emb, path = manager.resolve_embedder(tenant, embedder, backend(col))
    active = col.versions().active
    if embedder == active.embedder and path == active.model_path:
        raise InvalidRequest(
            f"collection {name!r} already uses embedder {embedder!r} (index version {active.version})",
            param="embedder",
            code="embedder_unchanged",
        )
    job_id = new_job_id()
    target = col.store.begin_build(
        lambda n: IndexVersion(n, embedder, path, emb.dim, job_id, time.time()), job_busy(jobs)
    )
    jobs.create(job_id, tenant, name, kind=KIND)
    if gate is not None:  # before the job is queued: its worker reads it
        jobs.update(job_id, gate=gate.model_dump_json())
    dispatch(tenant, name, job_id)
    return ReindexResponse(
        job_id=job_id,
        collection=name,
        embedder=embedder,
        index_version=target.version,
        status_url=f"/v1/jobs/{job_id}",
        events_url=f"/v1/jobs/{job_id}/events",
    )


def stage_all(
    col: Collection, version: int, embedder: Embedder, batch: int, progress: Callable[[int], None]
) -> None:
    """Embed every chunk that has no vector of ``version`` yet, a committed batch at a time."""
    while rows := col.store.unstaged(version, batch):
        col.store.stage(version, [v for v, _ in rows], embedder.embed_documents([t for _, t in rows]))
        progress(len(rows))


def rollback(manager: CollectionManager, jobs: JobStore, tenant: str, name: str) -> IndexState:
    """Switch back to the previous version; the version left becomes the previous one (so a
    second rollback returns to it). Chunks written since the switch are embedded first."""
    col = embedded(manager.get(tenant, name))
    state = col.versions()
    if state.previous is None:
        raise Conflict(
            f"collection {name!r} has no previous index version to roll back to "
            f"(index version {state.active.version} is the only one)",
            param="name",
            code="no_previous_version",
        )
    busy = job_busy(jobs)
    if state.building is not None and busy(state.building):
        raise Conflict(
            f"collection {name!r} is being reindexed (job {state.building.job_id}); roll back after it ends",
            param="name",
            code="reindex_running",
        )
    target = state.previous
    emb = manager.version_embedder(tenant, target, backend(col))
    stage_all(col, target.version, emb, manager.settings.reindex_batch, lambda _n: None)
    return col.switch_to(target, emb, busy)


def run_reindex(
    manager: CollectionManager,
    jobs: JobStore,
    tenant: str,
    collection: str,
    job_id: str,
    hook: Hook | None = None,
) -> ReindexResult | JobFailed:
    """Build the version ``job_id`` was queued for and switch to it (see the module's doc)."""
    step = hook or (lambda _s: None)
    target: IndexVersion | None = None
    col: Collection | None = None
    try:
        col = embedded(manager.get(tenant, collection))
        state = col.versions()
        raw = jobs.raw(job_id)
        verdict: GateVerdict | None = json.loads(raw["verdict"]) if raw.get("verdict") else None
        if state.active.job_id == job_id:
            # switched before a crash marked it done
            return _succeeded(jobs, job_id, col, state, verdict)
        if verdict is not None and not verdict["applied"]:
            return _kept(jobs, job_id, col, state, verdict)  # dropped before a crash marked it done
        if state.building is None or state.building.job_id != job_id:
            raise VersionSuperseded(
                f"reindex job {job_id} was replaced by another or its version was dropped"
            )
        target = state.building
        jobs.update(job_id, status="running")
        embedder = manager.version_embedder(tenant, target, backend(col))
        done = col.store.staged_count(target.version)
        jobs.update(job_id, chunks_done=done, chunks_total=col.store.counts()[1])

        def progress(n: int) -> None:
            nonlocal done
            done += n
            # Documents ingested meanwhile add chunks: the total follows.
            jobs.update(job_id, chunks_done=done, chunks_total=max(done, col.store.counts()[1]))
            step("staged")

        stage_all(col, target.version, embedder, manager.settings.reindex_batch, progress)
        if raw.get("gate"):
            verdict = judge(col, target, embedder, ReindexGate.model_validate_json(raw["gate"]))
            jobs.update(job_id, verdict=json.dumps(verdict))
            log.info("reindex job %s: %s", job_id, verdict["reason"])
            if not verdict["applied"]:
                col.store.abandon_build(target.version)
                return _kept(jobs, job_id, col, col.versions(), verdict)
        step("before_switch")
        state = col.switch_to(target, embedder, job_busy(jobs), step)
        step("after_switch")
        return _succeeded(jobs, job_id, col, state, verdict)
    except (TandemError, VersionSuperseded) as exc:
        message = exc.message if isinstance(exc, TandemError) else str(exc)
        _give_up(col, target)
        jobs.update(job_id, status="failed", error=message)
        return {"error": message}
    except Exception as exc:
        log.exception("reindex job %s failed", job_id)
        _give_up(col, target)
        jobs.update(job_id, status="failed", error=f"{type(exc).__name__}: {exc}")
        raise


def _give_up(col: Collection | None, target: IndexVersion | None) -> None:
    if col is not None and target is not None:
        col.store.abandon_build(target.version)


def _versions(state: IndexState, chunks: int) -> ReindexVersions:
    return {
        "embedder": state.active.embedder,
        "index_version": state.active.version,
        "previous_version": state.previous.version if state.previous else None,
        "chunks": chunks,
    }


def _succeeded(
    jobs: JobStore, job_id: str, col: Collection, state: IndexState, verdict: GateVerdict | None = None
) -> ReindexResult:
    chunks = col.store.counts()[1]
    versions = _versions(state, chunks)
    result: ReindexResult = versions if verdict is None else {**versions, **verdict}
    jobs.update(job_id, status="succeeded", result=result, chunks_done=chunks, chunks_total=chunks)
    return result


def _kept(
    jobs: JobStore, job_id: str, col: Collection, state: IndexState, verdict: GateVerdict
) -> ReindexGated:
    """The job's end when its gate kept the active version: succeeded, not applied."""
    result: ReindexGated = {**_versions(state, col.store.counts()[1]), **verdict}
    jobs.update(job_id, status="succeeded", result=result)
    return result
