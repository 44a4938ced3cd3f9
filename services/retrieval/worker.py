"""Celery app of the retrieval service: ``celery -A services.retrieval.worker:celery_app worker -Q io``,
and its beat (``... beat``, or ``-B`` on one io worker), which starts the syncs of the sources
collections follow when they are due (services/retrieval/sources/schedule.py).

It runs ingestion jobs: the embedding model is loaded once per worker process and
shared by its threads (``--pool threads``); the collection's SQLite log is how the API
process learns about the new chunks. Each job runs under a lease; every worker scans at
start-up and every ``TANDEM_RETRIEVAL_RECOVERY_INTERVAL_S`` for jobs whose worker died
(``ingest.recover_orphans``) and requeues them.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

from celery.signals import worker_ready, worker_shutdown

from services.common.celery_app import make_celery
from services.common.config import CommonSettings, SettingsError, load_settings
from services.common.jobs import TERMINAL
from services.common.leases import recovery_loop
from services.common.redis_conn import sync_redis
from services.common.telemetry import set_attributes, span
from services.retrieval.config import RetrievalSettings
from services.retrieval.core.jobs import JobStore
from services.retrieval.core.registry import CollectionManager
from services.retrieval.ingest import TASK_NAME, log, recover_orphans, run_leased
from services.retrieval.job_results import JobOutcome
from services.retrieval.metrics import record_ingest
from services.retrieval.sources.schedule import TICK_EVERY_S, TICK_TASK, start_due_syncs

common = load_settings(CommonSettings, check_unknown=False)
celery_app = make_celery("retrieval", common.redis_url, default_queue="io")
_stop = threading.Event()


@functools.cache
def _settings() -> RetrievalSettings:
    return load_settings(RetrievalSettings, check_unknown=False)


@functools.cache
def _manager() -> CollectionManager:
    return CollectionManager(
        common.home_dir, _settings(), common.allowed_model_roots, service_api_key=common.service_api_key
    )


@functools.cache
def _jobs() -> JobStore:
    return JobStore(sync_redis(common.redis_url))


@celery_app.task(name=TASK_NAME, bind=True)
def ingest(self: Any, tenant: str, collection: str, job_id: str) -> JobOutcome:
    try:
        manager = _manager()
    except SettingsError as exc:
        # This worker's backend settings do not match the collections (an io worker left on the
        # embedded backend beside Milvus replicas): the message is acknowledged here, so the job
        # would stay queued for ever with the reason only in this log. Fail it, naming the setting.
        # A job that is gone (expired), ended, or leased by a healthy worker is left alone.
        log.error("ingestion job %s: %s", job_id, exc)
        jobs = _jobs()
        raw = jobs.raw(job_id)
        if raw and raw.get("status") not in TERMINAL and jobs.leases.owner(job_id) is None:
            jobs.update(job_id, status="failed", error=str(exc))
        return {"error": str(exc)}
    # the job's span is a child of the Celery task's, which continues the trace of the upload
    with span("ingest.job", collection=collection, job_id=job_id) as current:
        start = time.perf_counter()
        result = run_leased(manager, _jobs(), _settings(), tenant, collection, job_id)
        set_attributes(current, **{k: v for k, v in result.items() if isinstance(v, int | str)})
    record_ingest(_jobs().r, result, time.perf_counter() - start)
    return result


def dispatch(tenant: str, collection: str, job_id: str) -> None:
    celery_app.send_task(TASK_NAME, args=[tenant, collection, job_id], queue="io")


@celery_app.task(name=TICK_TASK)
def start_due_source_syncs() -> list[str]:
    """The beat's tick: queue the sync of every source whose next sync is due."""
    return start_due_syncs(_manager(), _jobs(), dispatch, time.time())


# Celery beat (``celery -A services.retrieval.worker:celery_app beat``, or ``-B`` on one io
# worker) sends the tick; a tick older than its period is dropped rather than run late twice.
celery_app.conf.beat_schedule = {
    "start-due-source-syncs": {
        "task": TICK_TASK,
        "schedule": TICK_EVERY_S,
        "options": {"queue": "io", "expires": TICK_EVERY_S},
    }
}


@worker_ready.connect
def _on_ready(**_: Any) -> None:
    def scan() -> list[str]:
        return recover_orphans(_jobs(), _settings(), dispatch)

    threading.Thread(
        target=recovery_loop,
        args=(scan, _settings().recovery_interval_s, _stop, "ingestion jobs"),
        name="ingestion-recovery",
        daemon=True,
    ).start()


@worker_shutdown.connect
def _on_shutdown(**_: Any) -> None:
    _stop.set()
