"""Request ids, access logs, Prometheus metrics, and the health routes.

``/healthz`` says the process is alive; ``/readyz`` runs the service's readiness
checks (Redis reachable, model loaded, ...) and answers 503 naming each failing
one (with the reason only for a caller presenting an API key); ``/metrics`` is Prometheus text. None of them needs an API key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.logs import REQUEST_ID_HEADER, new_request_id, request_id_var

log = logging.getLogger("tandem.access")

ReadinessCheck = Callable[[], Awaitable[None]]


@dataclass
class Readiness:
    """Named async checks; each raises (with a reason) when its dependency is not ready."""

    checks: dict[str, ReadinessCheck]

    async def run(self, timeout: float = 3.0) -> tuple[bool, dict[str, str]]:
        results: dict[str, str] = {}
        for name, check in self.checks.items():
            try:
                await asyncio.wait_for(check(), timeout)
                results[name] = "ok"
            except TimeoutError:
                results[name] = f"timed out after {timeout}s"
            except Exception as exc:
                results[name] = f"{type(exc).__name__}: {exc}"[:300]
        return all(v == "ok" for v in results.values()), results


class Metrics:
    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tandem_http_requests_total",
            "HTTP requests by route and status",
            ["service", "method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "tandem_http_request_duration_seconds",
            "HTTP request latency by route (to the end of the response body)",
            ["service", "method", "route"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )


class RequestContextMiddleware:
    """Pure ASGI (so streaming and websockets pass through untouched): sets the request id,
    echoes it in the response, writes one access-log line and records metrics."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        rid = headers.get(REQUEST_ID_HEADER.lower()) or new_request_id()
        token = request_id_var.set(rid)
        status = {"code": 0}
        start = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (REQUEST_ID_HEADER.encode(), rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            elapsed = time.perf_counter() - start
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "WS")
            code = str(status["code"] or (101 if scope["type"] == "websocket" else 500))
            if template not in ("/metrics", "/healthz"):
                self.metrics.requests.labels(self.metrics.service, method, template, code).inc()
                self.metrics.latency.labels(self.metrics.service, method, template).observe(elapsed)
                log.info(
                    "%s %s %s %.1fms",
                    method,
                    scope.get("path"),
                    code,
                    elapsed * 1000,
                    extra={
                        "fields": {"route": template, "status": int(code), "ms": round(elapsed * 1000, 1)}
                    },
                )
            request_id_var.reset(token)


async def _known_caller(request: Request) -> bool:
    from services.common.auth import bearer_token, verify_key

    token = bearer_token(request)
    client = getattr(request.app.state, "redis", None)
    if not token or client is None:
        return False
    try:
        return await verify_key(client, token) is not None
    except Exception:  # Redis down: readiness says so; the caller is simply not known
        return False


def health_router(readiness: Readiness, metrics: Metrics, service: str) -> APIRouter:
    router = APIRouter(tags=["health"])

    @router.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "service": service}

    @router.get(
        "/readyz",
        responses={
            200: {"description": "every check passes"},
            503: {
                "description": "a check fails (same body, status not_ready)",
                "content": {"application/json": {}},
            },
        },
    )
    async def readyz(request: Request) -> JSONResponse:
        ok, checks = await readiness.run()
        if not await _known_caller(request):
            # Exception text can name hosts, paths and versions: only key holders see it.
            checks = {name: "ok" if v == "ok" else "failing" for name, v in checks.items()}
        return JSONResponse(
            {"status": "ready" if ok else "not_ready", "service": service, "checks": checks},
            status_code=200 if ok else 503,
        )

    @router.get("/metrics", response_class=PlainTextResponse)  # Prometheus' text format
    async def prometheus(_: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return router


def install_observability(app: FastAPI, service: str, readiness: Readiness) -> Metrics:
    metrics = Metrics(service)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)
    app.include_router(health_router(readiness, metrics, service))
    return metrics


class RedisTotals:
    """Totals kept in one Redis hash, so that work done in another process (a Celery worker)
    shows on the API's ``/metrics``: workers add with :meth:`add`, :meth:`read` gives them back.
    A metric must never fail the work it measures: Redis errors are logged and skipped."""

    def __init__(self, client: Any, key: str) -> None:
        self.client = client
        self.key = key

    def add(self, **amounts: float) -> None:
        try:
            pipe = self.client.pipeline()
            for name, amount in amounts.items():
                pipe.hincrbyfloat(self.key, name, float(amount))
            pipe.execute()
        except Exception as exc:
            log.warning("metrics: could not add to %s (%s: %s)", self.key, type(exc).__name__, exc)

    def set(self, **values: float) -> None:
        try:
            self.client.hset(self.key, mapping={k: str(float(v)) for k, v in values.items()})
        except Exception as exc:
            log.warning("metrics: could not set %s (%s: %s)", self.key, type(exc).__name__, exc)

    def read(self) -> dict[str, float]:
        try:
            raw = self.client.hgetall(self.key)
        except Exception as exc:
            log.warning("metrics: could not read %s (%s: %s)", self.key, type(exc).__name__, exc)
            return {}
        out: dict[str, float] = {}
        for k, v in raw.items():
            name = k.decode() if isinstance(k, bytes) else str(k)
            try:
                out[name] = float(v)
            except ValueError:
                continue
        return out
