"""The ASGI guard: the key and the body limit are checked before a body is read, over real sockets."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel

from services.common.app_factory import create_service_app
from services.common.config import CommonSettings
from tests.conftest import auth
from tests.helpers.servers import serve_app


class Thing(BaseModel):
    name: str


def build(redis_url: str, **settings: object) -> FastAPI:
    router = APIRouter()

    @router.post("/v1/things")
    async def create(thing: Thing) -> dict[str, str]:
        return {"name": thing.name}

    @router.post("/v1/upload")
    async def upload(request: Request) -> dict[str, int]:
        n = 0
        async for part in request.stream():
            n += len(part)
        return {"bytes": n}

    common = CommonSettings(redis_url=redis_url, max_body_mb=1, **settings)  # type: ignore[arg-type]
    return create_service_app("demo", common, routers=[router], body_limits={"/v1/upload": 3 * 1024 * 1024})


@pytest.fixture()
def url(redis_url: str) -> Iterator[str]:
    with serve_app(build(redis_url)) as u:
        yield u


def _raw(url: str, head: str, timeout: float = 5.0) -> tuple[socket.socket, bytes]:
    """Send only the request head (no body) and read what the server answers within ``timeout``."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.sendall(head.encode())
    sock.settimeout(timeout)
    try:
        data = sock.recv(65536)
    except TimeoutError:
        data = b""
    return sock, data


def test_anonymous_malformed_json_is_401_not_400(url: str) -> None:
    r = httpx.post(f"{url}/v1/things", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 401, r.text
    assert r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{url}/v1/things", content=b"{not json", headers={"Authorization": "Bearer tdm_x_y"})
    assert r.status_code == 401 and "invalid or revoked" in r.json()["error"]["message"]


def test_huge_declared_body_is_refused_before_it_is_sent(url: str, api_key: str) -> None:
    # 10 GB announced, nothing sent: the answer must come without the server waiting for the body.
    head = (
        "POST /v1/things HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {api_key}\r\nContent-Length: 10000000000\r\n\r\n"
    )
    sock, data = _raw(url, head)
    sock.close()
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert b"1 MiB" in data and b"/v1/things" in data
    # anonymous: 401 at once, whatever the size
    sock, data = _raw(url, head.replace(f"Authorization: Bearer {api_key}\r\n", ""))
    sock.close()
    assert data.startswith(b"HTTP/1.1 401"), data[:200]


def test_chunked_body_is_cut_off_at_the_limit(url: str, api_key: str) -> None:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.sendall(
        (
            "POST /v1/upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            f"Authorization: Bearer {api_key}\r\n\r\n"
        ).encode()
    )
    chunk = b"x" * 65536
    sent = 0
    answer = b""
    try:
        while sent < 20 * 1024 * 1024:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                answer = sock.recv(65536)
                break
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        if not answer:
            sock.settimeout(5)
            answer = sock.recv(65536)
    except (BrokenPipeError, ConnectionResetError):
        sock.settimeout(5)
        answer = sock.recv(65536)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b"3 MiB" in answer
    # Refused while the client was still sending: an app that read on would answer only after
    # the last chunk, which this client never sends. (How far past 3 MiB the client got depends
    # on the kernel's socket buffers and the scheduler, so no tighter bound is asserted.)
    assert sent < 20 * 1024 * 1024


def test_route_limit_allows_its_own_size(url: str, api_key: str) -> None:
    r = httpx.post(f"{url}/v1/upload", content=b"y" * (2 * 1024 * 1024), headers=auth(api_key), timeout=30)
    assert r.status_code == 200 and r.json() == {"bytes": 2 * 1024 * 1024}
    r = httpx.post(f"{url}/v1/things", content=b"y" * (2 * 1024 * 1024), headers=auth(api_key), timeout=30)
    assert r.status_code == 413


def test_docs_need_a_key_unless_public(url: str, api_key: str, redis_url: str) -> None:
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(f"{url}{path}").status_code == 401, path
        assert httpx.get(f"{url}{path}", headers=auth(api_key)).status_code == 200, path
    with serve_app(build(redis_url, public_docs=True)) as public:
        assert httpx.get(f"{public}/openapi.json").status_code == 200
        assert httpx.get(f"{public}/docs").status_code == 200
        assert httpx.post(f"{public}/v1/things", json={"name": "a"}).status_code == 401
    # health, readiness and metrics stay public
    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(f"{url}{path}").status_code == 200, path


def test_readiness_hides_reasons_from_anonymous_callers(api_key: str) -> None:
    common = CommonSettings(redis_url="redis://127.0.0.1:1/0")
    with serve_app(create_service_app("demo", common)) as u:
        r = httpx.get(f"{u}/readyz")
        assert r.status_code == 503 and r.json()["checks"] == {"redis": "failing"}
        assert "Error" not in r.text and "127.0.0.1" not in r.text


def test_readiness_shows_reasons_to_key_holders(url: str, api_key: str, redis_url: str) -> None:
    async def broken() -> None:
        raise RuntimeError("model file /secret/path is missing")

    app = create_service_app("demo", CommonSettings(redis_url=redis_url), readiness={"model": broken})
    with serve_app(app) as u:
        anon = httpx.get(f"{u}/readyz").json()["checks"]
        assert anon == {"redis": "ok", "model": "failing"}
        keyed = httpx.get(f"{u}/readyz", headers=auth(api_key)).json()["checks"]
        assert "/secret/path" in keyed["model"]


def test_guard_answers_fast(url: str) -> None:
    # The refusal does not wait on a body: a bounded poll of many refusals stays quick.
    t0 = time.monotonic()
    for _ in range(20):
        assert httpx.post(f"{url}/v1/things", json={"name": "x"}).status_code == 401
    assert time.monotonic() - t0 < 10


def test_deep_json_and_nan_are_400_naming_the_field(url: str, api_key: str) -> None:
    deep = '{"name": "a", "x": ' + "[" * 5000 + "]" * 5000 + "}"
    r = httpx.post(
        f"{url}/v1/things", content=deep, headers={**auth(api_key), "content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert (
        "nested deeper than 64" in r.json()["error"]["message"]
        and r.json()["error"]["code"] == "json_too_deep"
    )
    for const in ("NaN", "Infinity", "-Infinity"):
        body = '{"name": "a", "meta": {"score": ' + const + "}}"
        r = httpx.post(
            f"{url}/v1/things", content=body, headers={**auth(api_key), "content-type": "application/json"}
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "body.meta.score" and "NaN and Infinity are refused" in err["message"]
    # malformed JSON from a key holder keeps the route's own 400 naming the position
    r = httpx.post(
        f"{url}/v1/things", content=b"{oops", headers={**auth(api_key), "content-type": "application/json"}
    )
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/things", json={"name": "ok"}, headers=auth(api_key)).json() == {"name": "ok"}


def test_openapi_declares_the_guards_answers(url: str, api_key: str) -> None:
    spec = httpx.get(f"{url}/openapi.json", headers=auth(api_key)).json()
    responses = spec["paths"]["/v1/things"]["post"]["responses"]
    assert {"400", "401", "413"} <= set(responses)
