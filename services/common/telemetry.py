"""OpenTelemetry tracing: one trace per request across the services.

Each service (and each Celery worker) gets a ``TracerProvider`` whose resource names it
(``service.name``: ``agent``, ``retrieval``, ``inference``, ``trainer``, ``worker-io``, ...).
Spans go out over OTLP only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set; ``OTEL_EXPORTER_OTLP_PROTOCOL`` (or its
``_TRACES_`` form) picks ``http/protobuf`` (the default) or ``grpc``, and the exporters read
the other standard variables (headers, timeout, certificates) themselves.
``OTEL_SDK_DISABLED=true`` turns tracing off. Without an endpoint spans are still made (so
the W3C ``traceparent`` passed on to other services carries this service's span), and dropped.

Several services can live in one process (the tests run agent, retrieval and inference
side by side): the process-wide tracer provider is a router that hands each span to the
provider of the service whose request is being served (a context variable set per request),
else to the process's own service (the first one set up: a real process runs one).

Export never fails a request: spans leave from a background thread, and a failed export
is logged and counted (``tandem_otel_export_failures_total``).
"""

from __future__ import annotations

import contextvars
import logging
import os
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import httpx
from opentelemetry import propagate, trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Span, Tracer
from prometheus_client import CollectorRegistry, Counter
from starlette.types import ASGIApp, Receive, Scope, Send

from services.common.logs import current_trace_id as current_trace_id  # for callers of this module

log = logging.getLogger("tandem.telemetry")
T = TypeVar("T")

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
PROTOCOLS = ("http/protobuf", "grpc")
# Health probes and scrapes would be most of the spans and none of the interest.
EXCLUDED_URLS = "/healthz,/readyz,/metrics"

_service_provider: contextvars.ContextVar[SdkTracerProvider | None] = contextvars.ContextVar(
    "tandem_tracer_provider", default=None
)
_process_provider: SdkTracerProvider | None = None


def _first(env: Mapping[str, str], names: Sequence[str]) -> str:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return value
    return ""


def export_endpoint(env: Mapping[str, str] | None = None) -> str:
    """The OTLP endpoint the environment names; empty when export is off."""
    return _first(os.environ if env is None else env, ENDPOINT_VARS)


def export_protocol(env: Mapping[str, str] | None = None) -> str:
    protocol = _first(os.environ if env is None else env, PROTOCOL_VARS) or "http/protobuf"
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not one of {', '.join(PROTOCOLS)}")
    return protocol


def disabled(env: Mapping[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


class CountingExporter(SpanExporter):
    """An exporter whose failures (an error answer, an unreachable endpoint) are logged and
    counted instead of raised: the batch is dropped, the service carries on."""

    def __init__(self, inner: SpanExporter, failures: Counter, service: str) -> None:
        self.inner = inner
        self.failures = failures.labels(service)
        self.service = service

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception as exc:
            log.warning("%s: span export failed (%s: %s)", self.service, type(exc).__name__, exc)
            result = SpanExportResult.FAILURE
        else:
            if result is not SpanExportResult.SUCCESS:
                log.warning("%s: span export failed (%d spans dropped)", self.service, len(spans))
        if result is not SpanExportResult.SUCCESS:
            self.failures.inc()
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def otlp_exporter(protocol: str) -> SpanExporter:
    """The OTLP exporter of ``protocol``; it reads the endpoint and the rest from the environment."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http()


def export_failures(registry: CollectorRegistry) -> Counter:
    return Counter(
        "tandem_otel_export_failures",
        "Span batches the OTLP exporter could not deliver (dropped, never failing a request)",
        ["service"],
        registry=registry,
    )


def make_provider(
    service: str,
    registry: CollectorRegistry | None = None,
    *,
    exporter: SpanExporter | None = None,
    env: Mapping[str, str] | None = None,
) -> SdkTracerProvider:
    """``service``'s tracer provider, exporting to ``exporter`` (default: OTLP when the
    environment names an endpoint)."""
    resource = Resource.create({"service.name": service, "service.namespace": "tandem"})
    provider = SdkTracerProvider(resource=resource)
    if exporter is None and export_endpoint(env):
        exporter = otlp_exporter(export_protocol(env))
    if exporter is not None:
        failures = export_failures(registry or CollectorRegistry())
        provider.add_span_processor(BatchSpanProcessor(CountingExporter(exporter, failures, service)))
    return provider


class _RoutedTracer(Tracer):
    """A tracer that starts each span with the tracer of the service being served."""

    def __init__(self, args: tuple[Any, ...]) -> None:
        self._args = args
        self._tracers: dict[int, Tracer] = {}

    def _target(self) -> Tracer:
        provider = _service_provider.get() or _process_provider
        if provider is None:
            return trace.NoOpTracer()
        tracer = self._tracers.get(id(provider))
        if tracer is None:
            tracer = self._tracers[id(provider)] = provider.get_tracer(*self._args)
        return tracer

    def start_span(self, *args: Any, **kwargs: Any) -> Span:
        return self._target().start_span(*args, **kwargs)

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        return self._target().start_as_current_span(*args, **kwargs)


class RoutingTracerProvider(trace.TracerProvider):
    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: Any = None,
    ) -> Tracer:
        return _RoutedTracer(
            (instrumenting_module_name, instrumenting_library_version, schema_url, attributes)
        )


ROUTER = RoutingTracerProvider()
_global_set = False


def _install_router() -> None:
    """The router as OpenTelemetry's global provider (so ``trace.get_tracer`` anywhere routes),
    and Celery's publish and run hooks on it (task headers carry the trace context)."""
    global _global_set
    if _global_set:
        return
    _global_set = True
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        trace.set_tracer_provider(ROUTER)
    CeleryInstrumentor().instrument(tracer_provider=ROUTER)  # type: ignore[no-untyped-call]


def tracer(name: str = "tandem") -> Tracer:
    """The tracer code of the services starts its spans with."""
    return ROUTER.get_tracer(name)


@contextmanager
def span(name: str, **attributes: Any) -> Iterator[Span]:
    """A span around a block, with ``attributes`` (None values left out); an exception
    raised in the block is recorded on it and goes on."""
    with tracer().start_as_current_span(
        name, attributes={k: v for k, v in attributes.items() if v is not None}
    ) as current:
        yield current


def set_attributes(current: Span, **attributes: Any) -> None:
    current.set_attributes({k: v for k, v in attributes.items() if v is not None})


def setup_process(service: str, registry: CollectorRegistry | None = None) -> SdkTracerProvider | None:
    """Tracing for a process that runs ``service`` (a Celery worker); None when disabled."""
    global _process_provider
    if disabled():
        return None
    provider = make_provider(service, registry)
    _install_router()
    # a worker process serves one service: its spans go to it, whatever ran in the process before
    _process_provider = provider
    return provider


class ServiceContextMiddleware:
    """Pure ASGI: while a request is served, spans started anywhere go to this service."""

    def __init__(self, app: ASGIApp, provider: SdkTracerProvider) -> None:
        self.app = app
        self.provider = provider

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = _service_provider.set(self.provider)
        try:
            await self.app(scope, receive, send)
        finally:
            _service_provider.reset(token)


def instrument_app(app: Any, service: str, registry: CollectorRegistry) -> SdkTracerProvider | None:
    """Server spans for every request of ``app`` (the incoming ``traceparent`` continued);
    the provider is shut down (its spans flushed) with :func:`shutdown`."""
    global _process_provider
    if disabled():
        return None
    provider = make_provider(service, registry)
    _install_router()
    if _process_provider is None:
        _process_provider = provider
    app.add_middleware(ServiceContextMiddleware, provider=provider)
    # no span per ASGI message (one per streamed token would bury the trace)
    FastAPIInstrumentor.instrument_app(
        app, tracer_provider=provider, excluded_urls=EXCLUDED_URLS, exclude_spans=["receive", "send"]
    )
    return provider


def shutdown(provider: SdkTracerProvider | None) -> None:
    """Flush and stop ``provider`` (at the end of its app's life)."""
    global _process_provider
    if provider is None:
        return
    provider.shutdown()
    if _process_provider is provider:
        _process_provider = None


def instrument_client(client: httpx.Client | httpx.AsyncClient) -> None:
    """Client spans for ``client``'s requests, with ``traceparent`` sent on."""
    if not disabled():
        HTTPXClientInstrumentor.instrument_client(client, tracer_provider=ROUTER)


def with_trace_context(headers: Mapping[str, str] | None) -> dict[str, str]:
    """``headers`` plus the current trace context (``traceparent``), for plain ``httpx`` calls."""
    out = dict(headers or {})
    propagate.inject(out)
    return out


async def within(current: Span, stream: AsyncIterator[T]) -> AsyncIterator[T]:
    """``stream``'s items, each produced with ``current`` as the current span (so the calls it
    makes nest under it) and the span made current only while the stream works, never across a
    ``yield`` (whose consumer may run in another context). An exception is recorded on it."""
    try:
        while True:
            with trace.use_span(current, end_on_exit=False):
                try:
                    item = await anext(stream)
                except StopAsyncIteration:
                    return
            yield item
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


def process_provider() -> SdkTracerProvider | None:
    """The provider of the service this process runs (the first one set up), if any."""
    return _process_provider
