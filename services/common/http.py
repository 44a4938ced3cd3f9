"""HTTP clients for service-to-service calls: they pass the current request id and the trace
context (W3C ``traceparent``, with a client span per call) on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import httpx

from services.common.auth import ACT_FOR_HEADER
from services.common.logs import REQUEST_ID_HEADER, current_request_id
from services.common.telemetry import instrument_client

# The tenant an operator (service) key acts for on the calls made in this context: work a service
# does for a tenant outside any request of that tenant (the agent's promotion gate).
_acting_tenant: ContextVar[str | None] = ContextVar("acting_tenant", default=None)


@contextlib.contextmanager
def acting_for(tenant: str) -> Iterator[None]:
    """Service calls made inside send ``X-Tandem-Tenant: tenant`` (honoured for operator keys only)."""
    token = _acting_tenant.set(tenant)
    try:
        yield
    finally:
        _acting_tenant.reset(token)


def _tag(request: httpx.Request) -> None:
    """The current request's id and the tenant acted for, on a call made while serving it."""
    rid = current_request_id()
    if rid and REQUEST_ID_HEADER not in request.headers:
        request.headers[REQUEST_ID_HEADER] = rid
    tenant = _acting_tenant.get()
    if tenant is not None:
        request.headers[ACT_FOR_HEADER] = tenant


async def _add_request_id(request: httpx.Request) -> None:
    _tag(request)


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def service_client(
    base_url: str = "", api_key: str | None = None, timeout: float | httpx.Timeout = 60.0
) -> httpx.AsyncClient:
    client = httpx.AsyncClient(
        base_url=base_url, headers=_auth(api_key), timeout=timeout, event_hooks={"request": [_add_request_id]}
    )
    instrument_client(client)
    return client


def sync_service_client(
    base_url: str = "", api_key: str | None = None, timeout: float | httpx.Timeout = 60.0
) -> httpx.Client:
    """:func:`service_client` for synchronous code (worker threads): the same headers and spans."""
    client = httpx.Client(
        base_url=base_url, headers=_auth(api_key), timeout=timeout, event_hooks={"request": [_tag]}
    )
    instrument_client(client)
    return client
