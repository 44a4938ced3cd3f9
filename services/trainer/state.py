"""What the trainer's job logic works with: the settings, the job store and the job queue."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.common.config import CommonSettings
from services.trainer.config import TrainerSettings
from services.trainer.store import TrainerStore


@dataclass
class TrainerState:
    common: CommonSettings
    settings: TrainerSettings
    store: TrainerStore
    dispatch: Callable[[str, str], None]  # (job_id, queue): put the job on a Celery queue
