"""The Celery app factory used by every service that runs background work.

Queues are named per accelerator (``cpu``, ``gpu``, ``npu``) plus ``io`` for
ingestion and other I/O-bound work. Payloads are JSON with ids, never tensors;
job state lives in Redis hashes owned by each service, not in the result backend.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from celery import Celery
from celery.signals import worker_init, worker_shutdown
from kombu.entity import Queue

from services.common import telemetry
from services.common.redis_conn import CONNECT_TIMEOUT_S, SOCKET_TIMEOUT_S

QUEUES = ("cpu", "gpu", "npu", "io")
# Longer than the longest job: with the Redis transport an unacknowledged task is
# handed to another worker once this passes, so a short value would run long jobs twice.
DEFAULT_VISIBILITY_TIMEOUT_S = 7 * 24 * 3600


def make_celery(
    name: str,
    redis_url: str,
    *,
    include: list[str] | None = None,
    default_queue: str = "cpu",
    visibility_timeout_s: int = DEFAULT_VISIBILITY_TIMEOUT_S,
) -> Celery:
    app = Celery(name, broker=redis_url, backend=redis_url, include=include or [])
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_queues=[Queue(q) for q in QUEUES],  # type: ignore[no-untyped-call]  # kombu is untyped
        task_default_queue=default_queue,
        # Timeouts so that a Redis that stops answering is an error and a reconnect, not a hang.
        broker_transport_options={
            "visibility_timeout": visibility_timeout_s,
            "socket_connect_timeout": CONNECT_TIMEOUT_S,
            "socket_timeout": SOCKET_TIMEOUT_S,
            "socket_keepalive": True,
            "retry_on_timeout": True,
            "health_check_interval": 30,
        },
        result_backend_transport_options={
            "visibility_timeout": visibility_timeout_s,
            "retry_policy": {"max_retries": 3, "interval_start": 0.1, "interval_step": 0.5},
        },
        redis_socket_connect_timeout=CONNECT_TIMEOUT_S,
        redis_socket_timeout=SOCKET_TIMEOUT_S,
        redis_socket_keepalive=True,
        redis_retry_on_timeout=True,
        redis_backend_health_check_interval=30,
        broker_connection_retry=True,
        broker_connection_max_retries=None,
        result_expires=24 * 3600,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        task_track_started=True,
    )

    _trace_workers(app)

    @app.task(name="tandem.ping")  # type: ignore[untyped-decorator]  # celery is untyped
    def ping(payload: Any = None) -> dict[str, Any]:
        """Round trip through the broker: proves a worker consumes its queue."""
        return {"pong": True, "app": name, "host": socket.gethostname(), "echo": payload}

    return app


def worker_service_name(queues: list[str]) -> str:
    """A worker's ``service.name``: ``OTEL_SERVICE_NAME`` when set (``tandem up`` sets it per
    worker), else ``worker-`` and the queues it consumes (``worker-io``)."""
    return os.environ.get("OTEL_SERVICE_NAME", "").strip() or "worker-" + "-".join(
        sorted(queues) or ["default"]
    )


def _trace_workers(app: Celery) -> None:
    """A worker of ``app`` traces its tasks as its own service: each task a span continuing the
    trace of whoever queued it (Celery's instrumentation carries ``traceparent`` in the task
    headers), its spans flushed when the worker stops."""
    providers: list[Any] = []

    def started(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        queues = list(getattr(sender.app.amqp.queues, "consume_from", None) or {})
        provider = telemetry.setup_process(worker_service_name(queues))
        if provider is not None:
            providers.append(provider)

    def stopped(sender: Any = None, **_: Any) -> None:
        while providers:
            telemetry.shutdown(providers.pop())

    worker_init.connect(started, weak=False)
    worker_shutdown.connect(stopped, weak=False)
