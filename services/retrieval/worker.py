"""Celery app of the retrieval service: ``celery -A services.retrieval.worker:celery_app worker -Q io``."""

from __future__ import annotations

from services.common.celery_app import make_celery
from services.common.config import CommonSettings, load_settings

common = load_settings(CommonSettings, check_unknown=False)
celery_app = make_celery("retrieval", common.redis_url, default_queue="io")
