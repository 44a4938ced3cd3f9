"""HTTP clients for service-to-service calls: they pass the current request id and the trace
context (W3C ``traceparent``, with a client span per call) on."""

from __future__ import annotations

import httpx

from services.common.logs import REQUEST_ID_HEADER, current_request_id
from services.common.telemetry import instrument_client


async def _add_request_id(request: httpx.Request) -> None:
    rid = current_request_id()
    if rid and REQUEST_ID_HEADER not in request.headers:
        request.headers[REQUEST_ID_HEADER] = rid


def service_client(
    base_url: str = "", api_key: str | None = None, timeout: float | httpx.Timeout = 60.0
) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=timeout, event_hooks={"request": [_add_request_id]}
    )
    instrument_client(client)
    return client
