"""Celery app of the trainer service: ``celery -A services.trainer.worker:celery_app worker -Q cpu``.

Tasks (explicit names, payloads are ids):

- ``tandem.trainer.run_job(job_id)``: run (or resume) a job; idempotent, see ``runner``.
- ``tandem.trainer.recover``: requeue jobs whose worker died. Every worker also runs it
  at start-up and then every ``TANDEM_TRAINER_RECOVERY_INTERVAL_S`` in a thread.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

from celery.signals import worker_ready, worker_shutdown

from services.common.celery_app import make_celery
from services.common.config import CommonSettings, load_settings
from services.common.leases import recovery_loop
from services.common.redis_conn import sync_redis
from services.common.telemetry import set_attributes, span
from services.trainer.config import TrainerSettings

log = logging.getLogger("tandem.trainer.worker")

RUN_JOB = "tandem.trainer.run_job"
RECOVER = "tandem.trainer.recover"
JOIN_JOB = "tandem.trainer.join_job"

common = load_settings(CommonSettings, check_unknown=False)
celery_app = make_celery("trainer", common.redis_url, default_queue="cpu")
_stop = threading.Event()


def _store() -> Any:
    from services.trainer.store import TrainerStore

    return TrainerStore(sync_redis(common.redis_url))


def dispatch(job_id: str, queue: str) -> None:
    celery_app.send_task(RUN_JOB, args=[job_id], queue=queue)


@celery_app.task(name=RUN_JOB)
def run_job(job_id: str) -> str:
    from services.trainer.publish import publish
    from services.trainer.runner import execute

    settings = load_settings(TrainerSettings, check_unknown=False)
    store = _store()
    # a child of the Celery task's span, in the trace of the request that created the job
    with span("train.job", job_id=job_id) as current:
        outcome = execute(
            job_id,
            store=store,
            common=common,
            settings=settings,
            publish=lambda jid, spec, path: publish(common, jid, spec, path),
            join=dispatch_join,
        )
        set_attributes(current, outcome=outcome)
    return outcome


def dispatch_join(job_id: str, endpoint: str, rdzv_id: str, queue: str) -> None:
    celery_app.send_task(JOIN_JOB, args=[job_id, endpoint, rdzv_id], queue=queue)


@celery_app.task(name=JOIN_JOB)
def join_job(job_id: str, endpoint: str, rdzv_id: str) -> int:
    """This machine's ranks of a multi-node job another worker leads (see ``launch``)."""
    from services.trainer.launch import join_distributed
    from services.trainer.paths import job_dir

    settings = load_settings(TrainerSettings, check_unknown=False)
    store = _store()
    if store.job(job_id).get("status") != "running":
        return -1  # finished or cancelled before this machine got to it
    try:
        return join_distributed(job_id, endpoint, rdzv_id, work=job_dir(common, job_id), settings=settings)
    except Exception as exc:  # this machine cannot take part: the lead's rendezvous will time out
        store.log(job_id, f"worker on {socket.gethostname()} could not join: {exc}", level="error")
        return -1


@celery_app.task(name=RECOVER)
def recover() -> list[str]:
    from services.trainer.runner import recover_orphans

    return recover_orphans(_store(), load_settings(TrainerSettings, check_unknown=False), dispatch)


def _recovery_loop() -> None:
    from services.trainer.runner import recover_orphans

    settings = load_settings(TrainerSettings, check_unknown=False)
    store = _store()
    recovery_loop(
        lambda: recover_orphans(store, settings, dispatch),
        settings.recovery_interval_s,
        _stop,
        "training jobs",
    )


@worker_ready.connect
def _on_ready(**_: Any) -> None:
    threading.Thread(target=_recovery_loop, name="trainer-recovery", daemon=True).start()


@worker_shutdown.connect
def _on_shutdown(**_: Any) -> None:
    _stop.set()
