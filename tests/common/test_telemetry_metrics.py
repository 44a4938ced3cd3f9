"""Metrics that cross processes through Redis (a worker adds, the API's /metrics reads): the
retrieval service's ingestion totals and the trainer's jobs, steps and throughput."""

from __future__ import annotations

import redis
from prometheus_client import CollectorRegistry

from services.common.observability import RedisTotals
from services.retrieval.metrics import INGEST_TOTALS_KEY, QUERY_SECONDS, RetrievalCollector, record_ingest
from services.trainer.metrics import STATUS_KEY, STEPS_KEY, StepTimer, TrainerCollector
from services.trainer.store import ACTIVE, TrainerStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_ingestion_totals_reach_the_api(redis_client: redis.Redis) -> None:
    redis_client.delete(INGEST_TOTALS_KEY)
    record_ingest(redis_client, {"documents": 3, "chunks_added": 12}, 2.0)
    record_ingest(redis_client, {"error": "bad file"}, 0.1)
    registry = CollectorRegistry()
    registry.register(RetrievalCollector(lambda: None, redis_client))
    assert registry.get_sample_value("tandem_retrieval_ingested_chunks_total") == 12
    assert registry.get_sample_value("tandem_retrieval_ingested_documents_total") == 3
    assert registry.get_sample_value("tandem_retrieval_ingest_seconds_total") == 2.0
    assert registry.get_sample_value("tandem_retrieval_ingest_jobs_total", {"outcome": "failed"}) == 1
    assert registry.get_sample_value("tandem_retrieval_collections_open") == 0


def test_query_latency_is_labelled_by_mode() -> None:
    registry = CollectorRegistry()
    registry.register(QUERY_SECONDS)
    before = registry.get_sample_value("tandem_retrieval_query_seconds_count", {"mode": "dense"}) or 0
    QUERY_SECONDS.labels("dense").observe(0.01)
    assert registry.get_sample_value("tandem_retrieval_query_seconds_count", {"mode": "dense"}) == before + 1


def test_trainer_jobs_steps_and_throughput(redis_client: redis.Redis) -> None:
    redis_client.delete(STATUS_KEY, STEPS_KEY)
    store = TrainerStore(redis_client)
    # A tenant and job of this test's own: the session's Valkey is shared, and a half-made job
    # in a real tenant's list would be listed by other tests.
    store.create_job("metrics-only", "job-m1", {"type": "sft", "spec": "{}"})
    store.set_status("job-m1", "running")
    clock = Clock()
    timer = StepTimer(redis_client, clock)
    timer.report(10, {"tokens_per_s": 100.0})
    clock.now = 5.0
    timer.report(20, {"tokens_per_s": 250.0, "loss": 1.0})
    registry = CollectorRegistry()
    registry.register(TrainerCollector(redis_client, ACTIVE))
    assert registry.get_sample_value("tandem_trainer_jobs_total", {"status": "running"}) == 1
    assert registry.get_sample_value("tandem_trainer_jobs_running") >= 1
    assert registry.get_sample_value("tandem_trainer_tokens_per_second") == 250.0
    assert registry.get_sample_value("tandem_trainer_step_seconds") == 0.5  # 5 s over 10 steps
    assert registry.get_sample_value("tandem_trainer_steps_total") == 10
    store.set_status("job-m1", "succeeded")
    assert registry.get_sample_value("tandem_trainer_jobs_total", {"status": "succeeded"}) == 1


def test_redis_down_never_fails_the_work() -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    totals = RedisTotals(dead, "k")
    totals.add(x=1)  # logged, not raised
    assert totals.read() == {}
