"""What the routers share: the app's trainer state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request
from starlette.requests import HTTPConnection

from services.common.config import CommonSettings
from services.trainer.config import TrainerSettings
from services.trainer.store import TrainerStore


@dataclass
class TrainerState:
    common: CommonSettings
    settings: TrainerSettings
    store: TrainerStore
    dispatch: Callable[[str, str], None]  # (job_id, queue): put the job on a Celery queue


def state_of(conn: Request | HTTPConnection) -> TrainerState:
    st = conn.app.state.trainer
    assert isinstance(st, TrainerState)
    return st
