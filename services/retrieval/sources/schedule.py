"""Starting syncs: on demand (``POST .../sources/{id}/sync``) and on schedule.

A sync is a job in Redis (kind ``sync``) queued on the io queue. One runs at a time per source:
the job is created first, then claimed as the source's ``running_job`` in one SQLite
transaction (store.py), which refuses while another sync's job is queued or running; the loser
is marked cancelled and the running job is answered instead. A job that vanished from Redis,
or ended, does not hold the source.

The schedule is a Celery beat entry (worker.py) that runs ``start_due_syncs`` every minute on
the io queue: each collection's ``sources.sqlite3`` under ``$TANDEM_HOME/retrieval/`` is asked
for the sources whose ``next_sync_at`` has passed. The claim makes a tick idempotent, so two
beats (two machines that each run ``tandem up`` on one stack) start each sync once.
"""

from __future__ import annotations

import logging

from services.common.jobs import TERMINAL
from services.retrieval.core.jobs import Dispatch, JobStore, new_job_id
from services.retrieval.core.registry import CollectionManager
from services.retrieval.sources.store import FILE_NAME, SYNC_KIND, Source, SourceStore

log = logging.getLogger("tandem.retrieval.sources")

# The beat's task, run on the io queue.
TICK_TASK = "tandem.retrieval.sources.start_due"
TICK_EVERY_S = 60.0


def job_busy(jobs: JobStore, job_id: str) -> bool:
    """Whether the job is queued or running (one Redis no longer knows is not)."""
    job = jobs.get(job_id)
    return job is not None and job.status not in TERMINAL


def start_sync(
    store: SourceStore, jobs: JobStore, tenant: str, collection: str, source: Source, dispatch: Dispatch
) -> tuple[str, bool]:
    """(the sync's job id, whether it was already running) for ``source``."""
    job_id = new_job_id()
    jobs.create(job_id, tenant, collection, kind=SYNC_KIND)
    jobs.update(job_id, source_id=source.id)
    try:
        running = store.claim(source.id, job_id, lambda j: job_busy(jobs, j))
    except BaseException:
        jobs.update(job_id, status="cancelled", error=f"source {source.id!r} is gone")
        raise
    if running is not None:
        jobs.update(
            job_id, status="cancelled", error=f"source {source.id!r} was syncing already (job {running})"
        )
        return running, True
    try:
        dispatch(tenant, collection, job_id)
    except BaseException:
        jobs.update(job_id, status="failed", error="the sync could not be queued")
        raise
    return job_id, False


def start_due_syncs(manager: CollectionManager, jobs: JobStore, dispatch: Dispatch, now: float) -> list[str]:
    """Start every sync due at ``now`` that is not running; the ids of the jobs started."""
    started: list[str] = []
    for db in sorted(manager.base.glob(f"*/*/{FILE_NAME}")):
        tenant, name = db.parent.parent.name, db.parent.name
        if tenant.startswith(".") or name.startswith("."):
            continue  # a collection being created or deleted
        try:
            if not manager.backend.exists(tenant, name):
                continue
            store = SourceStore(db.parent, name)
            for source in store.due(now):
                if source.running_job and job_busy(jobs, source.running_job):
                    continue
                job_id, already = start_sync(store, jobs, tenant, name, source, dispatch)
                if not already:
                    log.info("scheduled sync of source %s (%s/%s): job %s", source.id, tenant, name, job_id)
                    started.append(job_id)
        except Exception:
            # one collection's trouble (a locked or damaged file) does not stop the others' syncs
            log.exception("starting the due syncs of %s/%s failed", tenant, name)
    return started
