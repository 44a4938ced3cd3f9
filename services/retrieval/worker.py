"""Celery app of the retrieval service: ``celery -A services.retrieval.worker:celery_app worker -Q io``.

It runs ingestion jobs: the embedding model is loaded once per worker process and
shared by its threads (``--pool threads``); the collection's SQLite log is how the API
process learns about the new chunks.
"""

from __future__ import annotations

import functools
from typing import Any

from services.common.celery_app import make_celery
from services.common.config import CommonSettings, load_settings
from services.common.redis_conn import sync_redis
from services.retrieval.config import RetrievalSettings
from services.retrieval.core.jobs import JobStore
from services.retrieval.core.registry import CollectionManager
from services.retrieval.ingest import TASK_NAME, run_job

common = load_settings(CommonSettings, check_unknown=False)
celery_app = make_celery("retrieval", common.redis_url, default_queue="io")


@functools.cache
def _manager() -> CollectionManager:
    settings = load_settings(RetrievalSettings, check_unknown=False)
    return CollectionManager(
        common.home_dir, settings, common.allowed_model_roots, service_api_key=common.service_api_key
    )


@functools.cache
def _jobs() -> JobStore:
    return JobStore(sync_redis(common.redis_url))


@celery_app.task(name=TASK_NAME, bind=True)
def ingest(self: Any, tenant: str, collection: str, job_id: str) -> dict[str, Any]:
    return run_job(_manager(), _jobs(), tenant, collection, job_id)
