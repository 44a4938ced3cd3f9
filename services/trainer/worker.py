"""Celery app of the trainer service: ``celery -A services.trainer.worker:celery_app worker -Q cpu``."""

from __future__ import annotations

from services.common.celery_app import make_celery
from services.common.config import CommonSettings, load_settings

common = load_settings(CommonSettings, check_unknown=False)
celery_app = make_celery("trainer", common.redis_url, default_queue="cpu")
