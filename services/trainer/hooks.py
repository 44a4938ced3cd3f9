"""A running job's hooks into its store: progress, metrics, logs, cancel, and the lease.

The recipes call them (``recipes.base.Hooks``); under torchrun rank 0 calls them for every rank.
A job whose lease another worker has taken raises ``LeaseLost`` from them: the job stops without
touching the state the other worker now writes.
"""

from __future__ import annotations

import threading
import time

from services.trainer.metrics import StepTimer
from services.trainer.store import TrainerStore


class LeaseLost(RuntimeError):
    """Another worker took this job over (we were presumed dead): stop without touching its state."""


class JobHooks:
    def __init__(self, store: TrainerStore, job_id: str, lost: threading.Event) -> None:
        self.store = store
        self.job_id = job_id
        self.lost = lost
        self.steps = StepTimer(store.r, time.monotonic)  # tokens/s and step time for /metrics

    def should_stop(self) -> bool:
        if self.lost.is_set():
            raise LeaseLost(self.job_id)
        return self.store.cancel_requested(self.job_id)

    def report(self, step: int, total: int, metrics: dict[str, float]) -> None:
        if self.lost.is_set():
            raise LeaseLost(self.job_id)
        self.store.progress(self.job_id, step, total, {k: round(float(v), 6) for k, v in metrics.items()})
        self.steps.report(step, metrics)

    def log(self, message: str) -> None:
        self.store.log(self.job_id, message)

    def resumed(self, step: int) -> None:
        self.store.truncate_metrics(self.job_id, step)
        self.store.update(self.job_id, step=step)

    def evaluated(self, phase: str, metrics: dict[str, float]) -> None:
        if self.lost.is_set():
            raise LeaseLost(self.job_id)
        rounded = {k: round(float(v), 6) for k, v in metrics.items()}
        self.store.evaluation(self.job_id, phase, rounded)
        self.store.log(
            self.job_id, f"held-out eval {phase}: " + ", ".join(f"{k}={v:g}" for k, v in rounded.items())
        )
