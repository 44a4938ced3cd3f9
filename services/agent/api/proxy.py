"""Same-origin reverse proxy for the web front end: ``/api/{retrieval,trainer,inference}/{path}``.

The browser talks only to the agent's origin; these routes pass requests on to the
other services with the caller's Authorization and X-Request-ID headers, and
stream the answer back as it comes (SSE progress and token streams included).
Authentication is the upstream service's job (it sees the same key), so the
router is public here. A browser signed in by the session cookie is passed on as
``Authorization: Bearer <its token>``, once its write has shown the session's
``X-CSRF-Token`` (the upstream service sees a bearer and would not ask).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from services.common.auth import credential, csrf_refusal
from services.common.errors import InvalidRequest, ServiceUnavailable
from services.common.logs import REQUEST_ID_HEADER, current_request_id
from services.common.replicas import died, replica_pool

router = APIRouter(tags=["proxy"])

FORWARD_REQUEST_HEADERS = ("authorization", "content-type", "accept", "last-event-id", "cache-control")
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
    }
)


ROUTE = "/api/{service}/{path:path}"
# Above the largest upload a service behind the proxy takes by default (trainer datasets: 200 MiB).
MAX_BODY_MB = 256


@router.api_route(ROUTE, methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
async def proxy(
    service: Literal["retrieval", "trainer", "inference"], path: str, request: Request
) -> StreamingResponse:
    if any(part in ("..", ".") for part in path.split("/")):
        raise InvalidRequest(f"path {path!r} may not contain '.' or '..' segments", param="path")
    common = request.app.state.common
    # several inference replicas: a ready one (a proxied body cannot be sent twice, so no retry)
    pool = replica_pool(common.inference_replicas()) if service == "inference" else None
    base = pool.pick() if pool is not None else common.url_of(service)
    headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARD_REQUEST_HEADERS}
    cred = credential(request)
    if cred is not None and cred.from_cookie:
        refusal = csrf_refusal(request, cred)
        if refusal is not None:
            raise refusal
        headers["authorization"] = f"Bearer {cred.token}"
    rid = current_request_id() or request.headers.get(REQUEST_ID_HEADER)
    if rid:
        headers[REQUEST_ID_HEADER] = rid
    client = httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(30.0, read=None))
    upstream = client.build_request(
        request.method,
        "/" + path,
        params=list(request.query_params.multi_items()),
        headers=headers,
        content=request.stream() if request.method in ("POST", "PUT", "PATCH") else None,
    )
    try:
        resp = await client.send(upstream, stream=True)
    except httpx.HTTPError as exc:
        await client.aclose()
        if pool is not None and died(exc):
            pool.observe(base, False, f"{type(exc).__name__}: {exc}")
        raise ServiceUnavailable(f"{service} service unreachable: {type(exc).__name__}") from exc

    async def body() -> AsyncIterator[bytes]:
        async for piece in resp.aiter_raw():
            yield piece

    async def close() -> None:
        await resp.aclose()
        await client.aclose()

    out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
    if resp.headers.get("content-encoding"):
        out_headers["content-encoding"] = resp.headers["content-encoding"]
    return StreamingResponse(
        body(), status_code=resp.status_code, headers=out_headers, background=BackgroundTask(close)
    )
