"""``Idempotency-Key`` for POST routes that create things (jobs, files, collections, documents, feedback).

A client that did not see the answer (a timeout, a dropped connection) retries with the
same key and gets the first answer back instead of creating a second thing. The first
response is kept in Redis for ``TTL_S`` under the tenant, the route and the key, with a
fingerprint of the request: the same key with a different request is a 409, as is a retry
that arrives while the first request is still running. A request that failed with an error
frees its key, so the retry runs again.

Redis layout::

    tandem:idem:<service>:<tenant>:<METHOD> <route>:<sha256(key)> -> JSON
        {"state": "pending" | "done", "fingerprint": ..., "status": ..., "body": ...}
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import IO, Any

from fastapi import Request
from fastapi.responses import JSONResponse

from services.common.app_factory import RouteResponses
from services.common.errors import Conflict, InvalidRequest

HEADER = "Idempotency-Key"
TTL_S = 24 * 3600
# A first request that dies mid-way (kill -9) must not block its retries for a day.
PENDING_TTL_S = 600
MAX_KEY = 255
REPLAYED = "Idempotent-Replayed"

Create = Callable[[], Awaitable[tuple[int, Any]]]

# For the OpenAPI of the routes that take the header.
RESPONSES: RouteResponses = {
    409: {
        "description": "the Idempotency-Key was used with a different request, or its first request is still running"
    },
}


def _storage_key(request: Request, tenant: str, key: str) -> str:
    route = getattr(request.scope.get("route"), "path", request.url.path)
    service = getattr(request.app.state, "service", "tandem")
    digest = hashlib.sha256(key.encode()).hexdigest()
    return f"tandem:idem:{service}:{tenant}:{request.method} {route}:{digest}"


def file_fingerprint(parts: Iterable[tuple[str, IO[bytes]]], extra: str = "") -> str:
    """A fingerprint of uploaded (spooled) files: names, sizes and contents."""
    h = hashlib.sha256(extra.encode())
    for name, f in parts:
        f.seek(0)
        h.update(name.encode() + b"\0")
        while chunk := f.read(1 << 20):
            h.update(chunk)
        h.update(b"\0")
        f.seek(0)
    return h.hexdigest()


async def idempotent(
    request: Request, tenant: str, create: Create, *, fingerprint: str | None = None
) -> JSONResponse:
    """Run ``create`` (-> status, JSON body) once per Idempotency-Key; without the header, always."""
    key = request.headers.get(HEADER)
    if key is None:
        status, body = await create()
        return JSONResponse(body, status_code=status)
    if not key or len(key) > MAX_KEY or not key.isprintable():
        raise InvalidRequest(
            f"{HEADER} must be 1-{MAX_KEY} printable characters (got {key[:40]!r})", param=HEADER
        )
    if fingerprint is None:
        # the path too: one key on two collections' routes is two different requests
        fingerprint = hashlib.sha256(request.url.path.encode() + b"\0" + await request.body()).hexdigest()
    redis = request.app.state.redis
    skey = _storage_key(request, tenant, key)
    pending = json.dumps({"state": "pending", "fingerprint": fingerprint})
    if not await redis.set(skey, pending, nx=True, ex=PENDING_TTL_S):
        raw = await redis.get(skey)
        first = json.loads(raw) if raw else None
        if first is None:  # expired between the two calls: this request is the first
            return await idempotent(request, tenant, create, fingerprint=fingerprint)
        if first["fingerprint"] != fingerprint:
            raise Conflict(
                f"{HEADER} {key!r} was already used with a different request to this route; "
                "use a new key for a new request",
                param=HEADER,
                code="idempotency_key_reused",
            )
        if first["state"] != "done":
            raise Conflict(
                f"the first request with {HEADER} {key!r} is still running; retry later",
                param=HEADER,
                code="idempotency_in_progress",
                headers={"Retry-After": "1"},
            )
        return JSONResponse(first["body"], status_code=first["status"], headers={REPLAYED: "true"})
    try:
        status, body = await create()
    except BaseException:
        await redis.delete(skey)  # the request failed: a retry may run it again
        raise
    done = {"state": "done", "fingerprint": fingerprint, "status": status, "body": body}
    await redis.set(skey, json.dumps(done, default=str), ex=TTL_S)
    return JSONResponse(body, status_code=status)
