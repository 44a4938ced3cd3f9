"""Tracing of the shared app factory: spans over OTLP/HTTP to a real receiver, one trace across
two services over real HTTP, export off without an endpoint, a broken endpoint never failing
a request."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from services.common import telemetry
from services.common.app_factory import create_service_app
from services.common.config import CommonSettings
from services.common.http import service_client
from services.common.logs import REQUEST_ID_HEADER
from tests.common.otlp_receiver import Receiver, otlp_receiver
from tests.conftest import auth
from tests.helpers.servers import free_port, serve_app


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    with otlp_receiver() as r:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", r.url)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        yield r


def back_app(common: CommonSettings) -> FastAPI:
    routes = APIRouter()

    @routes.get("/v1/work")
    async def work() -> dict[str, str]:
        with telemetry.span("back.compute", items=3):
            return {"done": "yes"}

    return create_service_app("back", common, routers=[routes])


def front_app(common: CommonSettings, back_url: str, key: str) -> FastAPI:
    routes = APIRouter()

    @routes.get("/v1/ask")
    async def ask() -> dict[str, str]:
        with telemetry.span("front.call_back", target="back"):
            async with service_client(back_url, key) as client:
                resp = await client.get("/v1/work")
        return {"back": resp.json()["done"], "trace": telemetry.current_trace_id() or ""}

    return create_service_app("front", common, routers=[routes])


def test_one_trace_across_two_services(redis_url: str, api_key: str, receiver: Receiver) -> None:
    common = CommonSettings(redis_url=redis_url, log_json=False)
    with ExitStack() as stack:
        back_url = stack.enter_context(serve_app(back_app(common)))
        front_url = stack.enter_context(serve_app(front_app(common, back_url, api_key)))
        resp = httpx.get(f"{front_url}/v1/ask", headers=auth(api_key), timeout=30)
        assert resp.status_code == 200, resp.text
        trace_id = resp.json()["trace"]
        assert REQUEST_ID_HEADER in resp.headers
    # the apps are stopped: their providers flushed every span to the receiver
    spans = [s for s in receiver.spans if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in spans}
    assert {s.service for s in spans} == {"front", "back"}
    front_server = next(s for s in spans if s.service == "front" and s.parent_id == "")
    assert front_server.name == "GET /v1/ask"
    call = next(s for s in spans if s.name == "front.call_back")
    assert call.parent_id == front_server.span_id and call.attributes["target"] == "back"
    client = next(s for s in spans if s.service == "front" and s.parent_id == call.span_id)
    back_server = next(s for s in spans if s.service == "back" and s.name == "GET /v1/work")
    assert back_server.parent_id == client.span_id  # traceparent went over HTTP
    compute = next(s for s in spans if s.name == "back.compute")
    assert by_id[compute.parent_id] is back_server and compute.attributes["items"] == 3
    # health probes make no spans
    assert not [s for s in receiver.spans if "/readyz" in s.name]


def test_no_endpoint_no_export(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in telemetry.ENDPOINT_VARS:
        monkeypatch.delenv(name, raising=False)
    provider = telemetry.make_provider("quiet")
    assert provider._active_span_processor._span_processors == ()
    assert (
        telemetry.export_endpoint({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318"}) == "http://c:4318"
    )


def test_protocol_is_checked() -> None:
    assert telemetry.export_protocol({}) == "http/protobuf"
    assert telemetry.export_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "grpc"
    with pytest.raises(ValueError, match="'thrift'"):
        telemetry.export_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"})


def test_grpc_exporter_is_chosen() -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    assert isinstance(telemetry.otlp_exporter("grpc"), OTLPSpanExporter)


class Refusing(InMemorySpanExporter):
    def export(self, spans: object) -> SpanExportResult:  # type: ignore[override]
        raise ConnectionError("collector down")


def failures(registry: CollectorRegistry, service: str) -> float:
    value = registry.get_sample_value("tandem_otel_export_failures_total", {"service": service})
    return value or 0.0


def test_export_errors_are_counted_not_raised() -> None:
    registry = CollectorRegistry()
    provider = telemetry.make_provider("svc", registry, exporter=Refusing())
    with provider.get_tracer("t").start_as_current_span("work"):
        pass
    assert provider.force_flush()
    assert failures(registry, "svc") == 1
    provider.shutdown()


def test_broken_endpoint_never_fails_a_request(
    redis_url: str, api_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # nothing listens there: every export fails
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    routes = APIRouter()

    @routes.get("/v1/ok")
    async def ok() -> dict[str, bool]:
        return {"ok": True}

    app = create_service_app("broken", CommonSettings(redis_url=redis_url, log_json=False), routers=[routes])
    with serve_app(app) as url:
        for _ in range(3):
            assert httpx.get(f"{url}/v1/ok", headers=auth(api_key), timeout=30).json() == {"ok": True}
        assert app.state.tracing.force_flush(10_000) is True  # the batch was dealt with (dropped)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'tandem_otel_export_failures_total{service="broken"}' in metrics
    assert failures(app.state.metrics.registry, "broken") >= 1


def test_log_lines_carry_the_trace_id() -> None:
    import json
    import logging

    from services.common.logs import JsonFormatter

    provider = telemetry.make_provider("logs")
    record = logging.LogRecord("tandem", logging.INFO, __file__, 1, "hello", None, None)
    assert "trace_id" not in json.loads(JsonFormatter("svc").format(record))
    with provider.get_tracer("t").start_as_current_span("work") as current:
        line = json.loads(JsonFormatter("svc").format(record))
    assert line["trace_id"] == f"{current.get_span_context().trace_id:032x}"
