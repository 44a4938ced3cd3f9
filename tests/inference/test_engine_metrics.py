"""The inference service's engine metrics (vLLM's names) on a tiny random model: what a
request adds over real HTTP, the scheduler's queues per tenant, and the stream timings
under an injected clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from services.common.config import CommonSettings
from services.inference.app import create_app
from services.inference.config import InferenceSettings
from services.inference.engine.torch_engine import TorchEngine
from services.inference.engine.types import EngineRequest, SamplingParams, StreamEvent
from services.inference.metrics import EngineCollector, EngineMetrics, observed
from tests.conftest import auth
from tests.helpers.servers import serve_app


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str, lively_tiny_path: Path) -> Iterator[str]:
    home = tmp_path_factory.mktemp("engine-metrics")
    common = CommonSettings(home=home, redis_url=redis_url, model_roots=str(home), log_json=False)
    settings = InferenceSettings(model=str(lively_tiny_path), served_model_name="tiny", max_model_len=256)
    with serve_app(create_app(common, settings)) as url:
        yield url


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def chat(url: str, key: str, text: str, max_tokens: int = 6) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth(key), timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json()["usage"])


def test_a_request_counts_its_tokens_and_timings(server: str, key: str) -> None:
    before = scrape(server)
    usage = chat(server, key, "Count the tokens of this request, please.")
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, model_name="tiny", **labels) - value(
            before, name, model_name="tiny", **labels
        )

    assert delta("vllm:prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("vllm:generation_tokens_total") == usage["completion_tokens"] == 6
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 5  # between 6 tokens
    assert delta("vllm:request_queue_time_seconds_count") == 1
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    # the e2e latency is at least the time to the first token
    assert delta("vllm:e2e_request_latency_seconds_sum") >= delta("vllm:time_to_first_token_seconds_sum")
    assert value(after, "vllm:kv_cache_usage_perc", model_name="tiny") == 0.0  # nothing running now
    assert value(after, "tandem_adapters_resident", model_name="tiny") == 0


def test_a_repeated_prompt_hits_the_prefix_cache(server: str, key: str) -> None:
    text = "A long shared system prompt that the prefix cache keeps between two requests. " * 3
    before = scrape(server)
    first = chat(server, key, text)
    chat(server, key, text)
    after = scrape(server)
    queries = value(after, "vllm:prefix_cache_queries_total", model_name="tiny") - value(
        before, "vllm:prefix_cache_queries_total", model_name="tiny"
    )
    hits = value(after, "vllm:prefix_cache_hits_total", model_name="tiny") - value(
        before, "vllm:prefix_cache_hits_total", model_name="tiny"
    )
    assert queries == 2 * first["prompt_tokens"]
    # the second prompt found all but its last token (the first may share the chat template's
    # opening with an earlier request's)
    assert first["prompt_tokens"] - 1 <= hits < queries


def test_waiting_requests_are_counted_per_tenant_and_adapter(lively_tiny_path: Path) -> None:
    # the scheduler is not started: submitted requests stay waiting, nothing races the scrape
    engine = TorchEngine.from_pretrained(lively_tiny_path, name="tiny", max_batch_size=2)
    registry = SimpleNamespace(primary=engine, base_name="tiny", resident={}, loads=0)
    metrics = EngineMetrics(CollectorRegistry())
    collector = EngineCollector(metrics, lambda: registry)

    async def submit() -> None:
        for tenant in ("acme", "acme", "globex"):
            req = EngineRequest(request_id=f"r-{tenant}", params=SamplingParams(max_tokens=4), prompt="hi")
            req.tenant = tenant
            await engine.generate(req)

    asyncio.run(submit())
    families = {f.name: f for f in collector.collect()}
    waiting = {s.labels["tenant"]: s.value for s in families["vllm:num_requests_waiting"].samples}
    assert waiting == {"acme": 2, "globex": 1}
    assert not families["vllm:num_requests_running"].samples
    sample = families["vllm:num_requests_waiting"].samples[0]
    assert sample.labels["model_name"] == "tiny" and sample.labels["adapter"] == ""


class Ticks:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def event(index: int, finish: str | None = None, queued: float | None = None, done: int = 1) -> StreamEvent:
    return StreamEvent(index, [7], "x", None, finish, 10, done, queued_s=queued)  # type: ignore[arg-type]


def test_stream_timings_under_an_injected_clock() -> None:
    clock = Ticks()
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, clock=clock)

    async def engine() -> AsyncIterator[StreamEvent]:
        clock.now += 0.5  # prefill: first token after 0.5 s
        yield event(0, queued=0.2, done=1)
        for k in range(2, 4):
            clock.now += 0.1
            yield event(0, "length" if k == 3 else None, done=k)

    async def run() -> list[StreamEvent]:
        # waiting until the first token, then running (engines without a scheduler)
        stream = observed(engine(), metrics, model="m", adapter="", tenant="acme", n=1)
        first = await stream.__anext__()
        assert metrics.inflight.running[("m", "acme", "")] == 1
        assert metrics.inflight.waiting[("m", "acme", "")] == 0
        return [first] + [ev async for ev in stream]

    assert len(asyncio.run(run())) == 3
    assert metrics.inflight.running[("m", "acme", "")] == 0

    def sample(name: str) -> float:
        return registry.get_sample_value(name, {"model_name": "m"}) or 0.0

    assert sample("vllm:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert sample("vllm:inter_token_latency_seconds_count") == 2
    assert sample("vllm:inter_token_latency_seconds_sum") == pytest.approx(0.2)
    assert sample("vllm:e2e_request_latency_seconds_sum") == pytest.approx(0.7)
    assert sample("vllm:request_queue_time_seconds_sum") == pytest.approx(0.2)
    assert sample("vllm:prompt_tokens_total") == 10
    assert sample("vllm:generation_tokens_total") == 3
