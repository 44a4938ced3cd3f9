"""Builds the retrieval service's FastAPI app (``uvicorn services.retrieval.app:create_app --factory``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from services.common.access import AccessStore
from services.common.app_factory import create_service_app
from services.common.celery_app import make_celery
from services.common.config import CommonSettings, load_settings
from services.common.redis_conn import sync_redis
from services.retrieval.api import collections, documents, jobs, search, sources
from services.retrieval.config import RetrievalSettings
from services.retrieval.core.jobs import JobStore
from services.retrieval.core.registry import CollectionManager
from services.retrieval.metrics import install as install_retrieval_metrics

log = logging.getLogger("tandem.retrieval")


class EmbedderWarmup:
    """Loads the default embedding model in the background; readiness waits for it."""

    def __init__(self, manager: CollectionManager, model: str) -> None:
        self.error: str | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(manager, model), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self, manager: CollectionManager, model: str) -> None:
        try:
            if not manager.settings.embedder_url:  # a remote embedder is fetched on first use
                # With an ONNX default this also makes (or loads) the export before the first create.
                manager.embedder_named(model, backend=manager.settings.embedding_backend)
        except Exception as exc:
            log.exception("loading the embedding model %s failed", model)
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.done.set()

    async def check(self) -> None:
        if self.error:
            raise RuntimeError(f"embedding model failed to load: {self.error}")
        if not self.done.is_set():
            raise RuntimeError("embedding model is loading")


def _upload_limit(common: CommonSettings, settings: RetrievalSettings) -> int:
    return (settings.max_upload_mb or common.max_upload_mb) * 1024 * 1024


def create_app(common: CommonSettings | None = None, settings: RetrievalSettings | None = None) -> FastAPI:
    common = common or load_settings(CommonSettings, check_unknown=False)
    settings = settings or load_settings(RetrievalSettings)
    manager = CollectionManager(
        common.home_dir, settings, common.allowed_model_roots, service_api_key=common.service_api_key
    )
    warmup = EmbedderWarmup(manager, settings.embedding_model)
    job_redis = sync_redis(common.redis_url)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        warmup.start()
        try:
            yield
        finally:
            # Checkpoint the indexes so the next start replays little.
            manager.close_all()
            job_redis.close()

    app = create_service_app(
        "retrieval",
        common,
        tenant_limits=settings.tenant_limits(),
        routers=[collections.router, documents.router, search.router, jobs.router, sources.router],
        readiness={"embedder": warmup.check},
        lifespan=lifespan,
        # Uploads stream to disk under this limit (plus room for the multipart framing).
        body_limits={
            "/v1/collections/{name}/files": (
                _upload_limit(common, settings) + (1 << 20),
                f"uploads are limited to {_upload_limit(common, settings) >> 20} MiB a file: "
                "TANDEM_RETRIEVAL_MAX_UPLOAD_MB / TANDEM_MAX_UPLOAD_MB",
            )
        },
    )
    app.state.settings = settings
    app.state.collections = manager
    # who may read and write each collection (services/common/access.py)
    app.state.access = AccessStore(app.state.redis)
    app.state.jobs = JobStore(job_redis)
    app.state.celery = make_celery("retrieval", common.redis_url, default_queue="io")
    install_retrieval_metrics(app, job_redis)
    return app
