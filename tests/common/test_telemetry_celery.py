"""A Celery task continues the trace of whoever queued it: the publish injects ``traceparent``
into the task headers, the worker (its own ``service.name``) runs the task in that trace."""

from __future__ import annotations

import pytest
from celery.contrib.testing.worker import start_worker

from services.common import telemetry
from services.common.celery_app import make_celery, worker_service_name
from tests.common.otlp_receiver import otlp_receiver


def test_a_task_runs_in_the_trace_that_queued_it(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with otlp_receiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "worker-probe")
        app = make_celery("probe", redis_url, default_queue="io")
        publisher = telemetry.make_provider("publisher")
        token = telemetry._service_provider.set(publisher)  # as a request of the publisher would
        try:
            with start_worker(app, pool="solo", perform_ping_check=False, queues=["io"], shutdown_timeout=30):
                with telemetry.span("queue.it") as parent:
                    trace_id = f"{parent.get_span_context().trace_id:032x}"
                    result = app.send_task("tandem.ping", args=["hello"], queue="io")
                assert result.get(timeout=60)["echo"] == "hello"
            worker = telemetry.process_provider()  # set up by the worker's start (worker_init)
            assert worker is not None and worker.resource.attributes["service.name"] == "worker-probe"
            telemetry.shutdown(worker)  # what worker_shutdown does: flush
        finally:
            telemetry._service_provider.reset(token)
            publisher.shutdown()
    spans = [s for s in receiver.spans if s.trace_id == trace_id]
    by_name = {(s.service, s.name.split("/")[0]): s for s in spans}
    assert ("publisher", "queue.it") in by_name
    ran = [s for s in spans if s.service == "worker-probe"]
    assert ran, [(s.service, s.name) for s in receiver.spans]
    publish = next(s for s in spans if s.service == "publisher" and s.name == "apply_async/tandem.ping")
    run = next(s for s in ran if s.name == "run/tandem.ping")
    assert run.parent_id == publish.span_id  # traceparent went in the task's headers
    assert publish.parent_id == by_name[("publisher", "queue.it")].span_id


def test_worker_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    assert worker_service_name(["io"]) == "worker-io"
    assert worker_service_name(["gpu", "cpu"]) == "worker-cpu-gpu"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "worker-gpu-7")
    assert worker_service_name(["gpu"]) == "worker-gpu-7"
