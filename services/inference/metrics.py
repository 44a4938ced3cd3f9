"""The inference service's engine metrics, with vLLM's names and units where vLLM has one
(so dashboards built for vLLM work), and its ``generation`` span.

Per request, whatever the engine (torch, vllm, remote, llamacpp), :func:`observed` times
the stream the serving layer reads: ``vllm:time_to_first_token_seconds``,
``vllm:inter_token_latency_seconds``, ``vllm:e2e_request_latency_seconds``,
``vllm:request_queue_time_seconds`` (engines that report it), and counts
``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total``. On each scrape,
:class:`EngineCollector` reads the engine's state: ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` per tenant and adapter (the torch scheduler's own queues; for
other engines, requests before their first token count as waiting),
``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``
(in tokens, as vLLM counts them), prompt lookup's drafts as vLLM counts speculative decoding
(``vllm:spec_decode_num_drafts_total``, ``vllm:spec_decode_num_draft_tokens_total``,
``vllm:spec_decode_num_accepted_tokens_total``, and their ratio
``vllm:spec_decode_draft_acceptance_rate``), and the adapters resident and loaded.

Every metric carries ``model_name`` (the served name asked for: base model or adapter).
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common import telemetry
from services.inference.engine.types import StreamEvent

# vLLM's buckets (vllm/v1/metrics/loggers.py), so percentiles line up with its dashboards
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)

DEFAULT_TENANT = "default"


@dataclass
class InFlight:
    """Requests between their start and their end, for engines without a scheduler to ask:
    before their first token they wait, after it they run."""

    waiting: Tally[tuple[str, str, str]] = field(default_factory=Tally)
    running: Tally[tuple[str, str, str]] = field(default_factory=Tally)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.inflight = InFlight()
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefill tokens processed", ["model_name"], registry=registry
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens produced", ["model_name"], registry=registry
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token in seconds",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between consecutive output tokens in seconds",
            ["model_name"],
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End to end request latency in seconds",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time a request waited for a batch slot in seconds",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.success = Counter(
            "vllm:request_success",
            "Requests that ended, by finish reason",
            ["model_name", "finished_reason"],
            registry=registry,
        )


class EngineCollector(Collector):
    """Gauges read from the engine on each scrape. ``registry``: the app's model registry (None
    while the model loads)."""

    def __init__(self, metrics: EngineMetrics, registry: Callable[[], Any]) -> None:
        self.metrics = metrics
        self.registry = registry

    def collect(self) -> Iterator[Any]:
        labels = ["model_name", "tenant", "adapter"]
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests in a batch slot", labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting for a slot", labels=labels)
        kv = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage (1 means 100 percent)", labels=["model_name"]
        )
        queries = CounterMetricFamily(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels=["model_name"]
        )
        hits = CounterMetricFamily(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels=["model_name"]
        )
        resident = GaugeMetricFamily(
            "tandem_adapters_resident", "LoRA adapters loaded on the engines", labels=["model_name"]
        )
        loads = CounterMetricFamily(
            "tandem_adapter_loads", "LoRA adapter loads (first uses, publishes)", labels=["model_name"]
        )
        drafts = CounterMetricFamily(
            "vllm:spec_decode_num_drafts",
            "Drafts verified (a sequence's draft tokens in one step)",
            labels=["model_name"],
        )
        draft_tokens = CounterMetricFamily(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens verified", labels=["model_name"]
        )
        accepted = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", labels=["model_name"]
        )
        rate = GaugeMetricFamily(
            "vllm:spec_decode_draft_acceptance_rate",
            "Draft tokens accepted / draft tokens verified, since start",
            labels=["model_name"],
        )
        reg = self.registry()
        engine = getattr(reg, "primary", None)
        scheduler = getattr(engine, "scheduler", None)
        if reg is not None and engine is not None:
            base = str(getattr(reg, "base_name", "") or getattr(engine, "name", ""))
            if scheduler is not None:
                run, wait = scheduler_load(scheduler, base)
                kv.add_metric([base], kv_usage(scheduler))
                cache = scheduler.prefix_cache
                queries.add_metric([base], float(getattr(cache, "query_tokens", 0)))
                hits.add_metric([base], float(cache.hit_tokens))
                stats = getattr(scheduler, "lookup_stats", None)
                if stats is not None and getattr(scheduler, "prompt_lookup", None) is not None:
                    drafts.add_metric([base], float(stats.drafts))
                    draft_tokens.add_metric([base], float(stats.draft_tokens))
                    accepted.add_metric([base], float(stats.accepted_tokens))
                    rate.add_metric([base], stats.acceptance_rate)
            else:
                run, wait = self.metrics.inflight.running, self.metrics.inflight.waiting
            for key, n in run.items():
                if n:
                    running.add_metric(list(key), n)
            for key, n in wait.items():
                if n:
                    waiting.add_metric(list(key), n)
            resident.add_metric([base], len(getattr(engine, "adapters", {}) or {}) + _others(reg))
            loads.add_metric([base], float(getattr(reg, "loads", 0)))
        yield from (
            running,
            waiting,
            kv,
            queries,
            hits,
            resident,
            loads,
            drafts,
            draft_tokens,
            accepted,
            rate,
        )


def _others(reg: Any) -> int:
    """Adapters resident on engines other than the primary (registered full models)."""
    primary = getattr(reg, "primary", None)
    return sum(1 for r in getattr(reg, "resident", {}).values() if r.engine is not primary)


def scheduler_load(
    scheduler: Any, base: str
) -> tuple[Tally[tuple[str, str, str]], Tally[tuple[str, str, str]]]:
    """(running, waiting) sequences of the torch scheduler by (model, tenant, adapter)."""
    with scheduler._cv:  # the scheduler's own lock: a consistent snapshot
        slots, queued = list(scheduler.slots), list(scheduler.waiting)

    def key(seq: Any) -> tuple[str, str, str]:
        adapter = seq.adapter or ""
        return (adapter or base, str(seq.tenant or DEFAULT_TENANT), adapter)

    return Tally(key(s) for s in slots), Tally(key(s) for s in queued)


def kv_usage(scheduler: Any) -> float:
    """Positions held in the KV cache over the positions its slots can hold."""
    with scheduler._cv:
        held = sum(s.num_computed for s in scheduler.slots)
    capacity = scheduler.max_batch_size * scheduler.runner.max_len
    return min(1.0, held / capacity) if capacity else 0.0


async def observed(
    stream: AsyncIterator[StreamEvent],
    metrics: EngineMetrics | None,
    *,
    model: str,
    adapter: str,
    tenant: str | None,
    n: int,
) -> AsyncIterator[StreamEvent]:
    """``stream`` as it is, timed and counted, inside a ``generation`` span (a child of the
    request's span). ``n``: choices per prompt (the prompt tokens count once per prompt)."""
    clock = metrics.clock if metrics is not None else time.perf_counter
    start = clock()
    current = telemetry.tracer("tandem.inference").start_span(
        "generation",
        attributes={"gen_ai.request.model": model, "tandem.adapter": adapter, "tandem.tenant": tenant or ""},
    )
    key = (model, tenant or DEFAULT_TENANT, adapter)
    inflight = metrics.inflight if metrics is not None else None
    if inflight is not None:
        inflight.waiting[key] += 1
    first: float | None = None
    last: dict[int, float] = {}
    prompt: dict[int, int] = {}
    completion: dict[int, int] = {}
    reasons: list[str] = []
    queued: float | None = None
    try:
        async for ev in stream:
            now = clock()
            produced = bool(ev.token_ids or ev.text)
            if produced and first is None:
                first = now
                if inflight is not None:
                    inflight.waiting[key] -= 1
                    inflight.running[key] += 1
                if metrics is not None:
                    metrics.ttft.labels(model).observe(now - start)
            if ev.token_ids and ev.index in last and metrics is not None:
                metrics.itl.labels(model).observe(now - last[ev.index])
            if ev.token_ids:
                last[ev.index] = now
            if ev.queued_s is not None and queued is None:
                queued = ev.queued_s
                if metrics is not None:
                    metrics.queue_time.labels(model).observe(ev.queued_s)
            prompt[ev.index] = ev.prompt_tokens
            completion[ev.index] = ev.completion_tokens
            if ev.finish_reason is not None:
                reasons.append(ev.finish_reason)
            yield ev
    finally:
        end = clock()
        if inflight is not None:
            (inflight.waiting if first is None else inflight.running)[key] -= 1
        prompt_tokens = sum(v for i, v in prompt.items() if i % max(1, n) == 0)
        completion_tokens = sum(completion.values())
        if metrics is not None:
            metrics.prompt_tokens.labels(model).inc(prompt_tokens)
            metrics.generation_tokens.labels(model).inc(completion_tokens)
            metrics.e2e.labels(model).observe(end - start)
            for reason in reasons or ["abort"]:
                metrics.success.labels(model, reason).inc()
        telemetry.set_attributes(
            current,
            **{
                "gen_ai.usage.input_tokens": prompt_tokens,
                "gen_ai.usage.output_tokens": completion_tokens,
                "tandem.time_to_first_token_s": None if first is None else round(first - start, 6),
                "tandem.queue_wait_s": None if queued is None else round(queued, 6),
                "tandem.finish_reason": ",".join(reasons) or "abort",
            },
        )
        current.end()


def install(app: Any) -> EngineMetrics:
    """The engine metrics on ``app``'s ``/metrics`` (``app.state.metrics.registry``)."""
    registry = app.state.metrics.registry
    metrics = EngineMetrics(registry)
    registry.register(EngineCollector(metrics, lambda: getattr(app.state, "registry", None)))
    return metrics
