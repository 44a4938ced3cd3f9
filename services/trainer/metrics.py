"""The trainer's metrics: jobs by status, training throughput (tokens per second) and step time.

Jobs run in Celery workers (and under ``torchrun``); they add what they measure to Redis
hashes (:class:`RedisTotals`) that the trainer API's ``/metrics`` reads, so the API reports
every worker's jobs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.observability import RedisTotals

STATUS_KEY = "tandem:metrics:trainer:status"
STEPS_KEY = "tandem:metrics:trainer:steps"


def status_totals(client: Any) -> RedisTotals:
    return RedisTotals(client, STATUS_KEY)


def step_totals(client: Any) -> RedisTotals:
    return RedisTotals(client, STEPS_KEY)


class StepTimer:
    """Step time and throughput of one job from its progress reports (``clock``: seconds)."""

    def __init__(self, client: Any, clock: Callable[[], float]) -> None:
        self.totals = step_totals(client)
        self.clock = clock
        self.last: tuple[int, float] | None = None

    def report(self, step: int, metrics: dict[str, float]) -> None:
        now = self.clock()
        values: dict[str, float] = {}
        if "tokens_per_s" in metrics:
            values["tokens_per_s"] = float(metrics["tokens_per_s"])
        if self.last is not None and step > self.last[0]:
            steps = step - self.last[0]
            values["step_seconds"] = (now - self.last[1]) / steps
            self.totals.add(steps=steps, seconds=now - self.last[1])
        self.last = (step, now)
        if values:
            self.totals.set(**values)


class TrainerCollector(Collector):
    def __init__(self, redis_client: Any, active_key: str) -> None:
        self.client = redis_client
        self.active_key = active_key
        self.statuses = status_totals(redis_client)
        self.steps = step_totals(redis_client)

    def collect(self) -> Iterator[Any]:
        jobs = CounterMetricFamily("tandem_trainer_jobs", "Jobs that reached each status", labels=["status"])
        for status, n in sorted(self.statuses.read().items()):
            jobs.add_metric([status], n)
        running = GaugeMetricFamily("tandem_trainer_jobs_running", "Jobs running now")
        with contextlib.suppress(Exception):  # Redis down: /readyz says so; the scrape still answers
            running.add_metric([], float(self.client.scard(self.active_key)))
        steps = self.steps.read()
        tps = GaugeMetricFamily(
            "tandem_trainer_tokens_per_second", "Training throughput at the last progress report"
        )
        step_s = GaugeMetricFamily(
            "tandem_trainer_step_seconds", "Time per optimizer step at the last progress report"
        )
        total = CounterMetricFamily("tandem_trainer_steps", "Optimizer steps done")
        if "tokens_per_s" in steps:
            tps.add_metric([], steps["tokens_per_s"])
        if "step_seconds" in steps:
            step_s.add_metric([], steps["step_seconds"])
        total.add_metric([], steps.get("steps", 0.0))
        yield from (jobs, running, tps, step_s, total)


def install(app: Any, redis_client: Any, active_key: str) -> None:
    app.state.metrics.registry.register(TrainerCollector(redis_client, active_key))
