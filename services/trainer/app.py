"""Builds the trainer service's FastAPI app (``uvicorn services.trainer.app:create_app --factory``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from services.common.app_factory import create_service_app
from services.common.celery_app import make_celery
from services.common.config import CommonSettings, load_settings
from services.common.redis_conn import sync_redis
from services.trainer.api import files, jobs
from services.trainer.config import TrainerSettings
from services.trainer.metrics import install as install_trainer_metrics
from services.trainer.state import TrainerState
from services.trainer.store import ACTIVE, TrainerStore

RUN_JOB = "tandem.trainer.run_job"  # the worker's task name (services/trainer/worker.py)


def create_app(common: CommonSettings | None = None, settings: TrainerSettings | None = None) -> FastAPI:
    common = common or load_settings(CommonSettings, check_unknown=False)
    settings = settings or load_settings(TrainerSettings)
    client = sync_redis(common.redis_url)
    # A Celery client only (no worker here): the API just puts job ids on queues.
    celery = make_celery("trainer", common.redis_url, default_queue=settings.default_queue)

    def dispatch(job_id: str, queue: str) -> None:
        celery.send_task(RUN_JOB, args=[job_id], queue=queue)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            client.close()

    upload_limit = settings.max_dataset_mb * 1024 * 1024
    app = create_service_app(
        "trainer",
        common,
        tenant_limits=settings.tenant_limits(),
        routers=[files.router, jobs.router],
        lifespan=lifespan,
        # The dataset upload streams to disk under this limit (plus room for the multipart framing).
        body_limits={
            "/v1/files": (
                upload_limit + (1 << 20),
                f"datasets are limited to {settings.max_dataset_mb} MiB: TANDEM_TRAINER_MAX_DATASET_MB",
            )
        },
    )
    app.state.settings = settings
    app.state.trainer = TrainerState(
        common=common, settings=settings, store=TrainerStore(client), dispatch=dispatch
    )
    install_trainer_metrics(app, client, ACTIVE)  # jobs by status, tokens/s, step time
    return app
