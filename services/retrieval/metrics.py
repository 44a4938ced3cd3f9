"""The retrieval service's metrics: query latency by mode, index sizes, ingestion throughput
and embedder batch latency.

Query and embedder timings are observed in the process that does the work; ingestion runs
in the ``io`` workers, which add their totals to a Redis hash (:class:`RedisTotals`) that
the API's ``/metrics`` reads, so the API reports the throughput of every worker.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.observability import RedisTotals

INGEST_TOTALS_KEY = "tandem:metrics:retrieval:ingest"
F = TypeVar("F", bound=Callable[..., Any])

# Process-wide (the embedders are shared by every collection of a process); each app's
# registry exposes them.
QUERY_SECONDS = Histogram(
    "tandem_retrieval_query_seconds",
    "Search latency by mode",
    ["mode"],
    buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=None,
)
EMBED_BATCH_SECONDS = Histogram(
    "tandem_retrieval_embed_batch_seconds",
    "Embedder latency per batch, by backend",
    ["backend"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=None,
)


def timed_batch(backend: str) -> Callable[[F], F]:
    """Times each call (one embedder batch) into ``tandem_retrieval_embed_batch_seconds``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                EMBED_BATCH_SECONDS.labels(backend).observe(time.perf_counter() - start)

        return timed  # type: ignore[return-value]

    return wrap


def ingest_totals(client: Any) -> RedisTotals:
    return RedisTotals(client, INGEST_TOTALS_KEY)


def record_ingest(client: Any, result: Mapping[str, object], seconds: float) -> None:
    """A finished ingestion job's counts (a worker calls this)."""
    if "error" in result:
        ingest_totals(client).add(jobs_failed=1)
        return

    def count(key: str) -> float:  # a reindex or skipped job has neither count
        value = result.get(key, 0)
        return float(value) if isinstance(value, int | float) else 0.0

    ingest_totals(client).add(
        jobs=1, documents=count("documents"), chunks=count("chunks_added"), seconds=seconds
    )


class RetrievalCollector(Collector):
    """Index sizes of the collections this process has open, and the workers' ingestion totals."""

    def __init__(self, manager: Callable[[], Any], redis_client: Any) -> None:
        self.manager = manager
        self.totals = ingest_totals(redis_client)

    def collect(self) -> Iterator[Any]:
        vectors = GaugeMetricFamily(
            "tandem_retrieval_index_vectors", "Dense vectors in the open collections' indexes"
        )
        open_ = GaugeMetricFamily("tandem_retrieval_collections_open", "Collections open in this process")
        manager = self.manager()
        cols = list(getattr(manager, "_open", {}).values()) if manager is not None else []
        vectors.add_metric([], float(sum(len(getattr(c, "dense", ()) or ()) for c in cols)))
        open_.add_metric([], float(len(cols)))
        totals = self.totals.read()
        jobs = CounterMetricFamily("tandem_retrieval_ingest_jobs", "Ingestion jobs ended", labels=["outcome"])
        jobs.add_metric(["succeeded"], totals.get("jobs", 0.0))
        jobs.add_metric(["failed"], totals.get("jobs_failed", 0.0))
        docs = CounterMetricFamily("tandem_retrieval_ingested_documents", "Documents ingested")
        docs.add_metric([], totals.get("documents", 0.0))
        chunks = CounterMetricFamily("tandem_retrieval_ingested_chunks", "Chunks added to indexes")
        chunks.add_metric([], totals.get("chunks", 0.0))
        seconds = CounterMetricFamily(
            "tandem_retrieval_ingest_seconds",
            "Time spent running ingestion jobs (chunks / seconds: throughput)",
        )
        seconds.add_metric([], totals.get("seconds", 0.0))
        yield from (vectors, open_, jobs, docs, chunks, seconds)


def install(app: Any, redis_client: Any) -> None:
    """The retrieval metrics on ``app``'s ``/metrics``."""
    registry: CollectorRegistry = app.state.metrics.registry
    registry.register(QUERY_SECONDS)
    registry.register(EMBED_BATCH_SECONDS)
    registry.register(RetrievalCollector(lambda: getattr(app.state, "collections", None), redis_client))
