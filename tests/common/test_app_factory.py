"""Auth, error shape, request ids and metrics of the shared app factory, over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fastapi import APIRouter, Depends, FastAPI
from pydantic import BaseModel, Field

from services.common.app_factory import create_service_app
from services.common.auth import KeyStore, Principal, require_principal
from services.common.config import CommonSettings
from services.common.errors import NotFound
from services.common.http import service_client
from services.common.logs import current_request_id
from tests.conftest import auth
from tests.helpers.servers import serve_app


class Item(BaseModel):
    name: str = Field(min_length=1)
    size: int = Field(ge=1, le=10)


def build_app(redis_url: str, downstream: str | None = None) -> FastAPI:
    router = APIRouter()
    items: dict[tuple[str, str], Item] = {}

    @router.post("/v1/items")
    async def create(item: Item, principal: Principal = Depends(require_principal)) -> dict[str, str]:
        items[(principal.tenant, item.name)] = item
        return {"name": item.name}

    @router.get("/v1/items/{name}")
    async def get(name: str, principal: Principal = Depends(require_principal)) -> Item:
        item = items.get((principal.tenant, name))
        if item is None:
            raise NotFound(f"no item named {name!r}", param="name")
        return item

    @router.get("/v1/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    @router.get("/v1/rid")
    async def rid() -> dict[str, str | None]:
        return {"request_id": current_request_id()}

    @router.get("/v1/forward")
    async def forward() -> dict[str, str | None]:
        assert downstream is not None
        async with service_client(downstream) as client:
            return (await client.get("/healthz-rid")).json()

    public = APIRouter()

    @public.get("/healthz-rid")
    async def healthz_rid() -> dict[str, str | None]:
        return {"request_id": current_request_id()}

    common = CommonSettings(redis_url=redis_url, log_json=True)
    return create_service_app("demo", common, routers=[router], public_routers=[public])


@pytest.fixture()
def base_url(redis_url: str) -> Iterator[str]:
    with serve_app(build_app(redis_url)) as url:
        yield url


def test_health_needs_no_key(base_url: str) -> None:
    assert httpx.get(f"{base_url}/healthz").json()["status"] == "ok"
    ready = httpx.get(f"{base_url}/readyz")
    assert ready.status_code == 200 and ready.json()["checks"] == {"redis": "ok"}
    assert httpx.get(f"{base_url}/metrics").status_code == 200


def test_missing_and_wrong_keys_get_401(base_url: str, api_key: str) -> None:
    for headers in ({}, {"Authorization": "Bearer tdm_nope_nope"}, {"Authorization": "Basic abc"}):
        resp = httpx.get(f"{base_url}/v1/items/x", headers=headers)
        assert resp.status_code == 401
        assert resp.json()["error"]["type"] == "authentication_error"
        assert resp.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{base_url}/v1/whoami", headers=auth(api_key)).json()["tenant"] == "acme"


def test_whoami_says_the_role_the_web_front_end_shows_or_hides_pages_by(
    base_url: str, key_store: KeyStore
) -> None:
    admin = key_store.create("acme", role="admin")[0]
    member = key_store.create("acme", role="member")[0]
    who = httpx.get(f"{base_url}/v1/whoami", headers=auth(admin)).json()
    assert (who["tenant"], who["role"], who["user_id"], who["groups"]) == ("acme", "admin", None, [])
    assert httpx.get(f"{base_url}/v1/whoami", headers=auth(member)).json()["role"] == "member"


def test_revoked_key_is_refused_at_once(base_url: str, key_store: KeyStore) -> None:
    key, record = key_store.create("acme")
    assert httpx.get(f"{base_url}/v1/whoami", headers=auth(key)).status_code == 200
    key_store.revoke(record.key_id)
    assert httpx.get(f"{base_url}/v1/whoami", headers=auth(key)).status_code == 401
    assert any(r.key_id == record.key_id and r.revoked for r in key_store.list("acme"))


def test_other_tenant_gets_404_never_content(base_url: str, api_key: str, other_key: str) -> None:
    assert (
        httpx.post(
            f"{base_url}/v1/items", json={"name": "secret", "size": 3}, headers=auth(api_key)
        ).status_code
        == 200
    )
    assert httpx.get(f"{base_url}/v1/items/secret", headers=auth(api_key)).json()["size"] == 3
    resp = httpx.get(f"{base_url}/v1/items/secret", headers=auth(other_key))
    assert resp.status_code == 404
    assert resp.json()["error"]["type"] == "not_found_error"
    assert "size" not in resp.text


def test_keys_are_stored_hashed(key_store: KeyStore, redis_client: object) -> None:
    key, record = key_store.create("acme")
    dump = str(redis_client.hgetall(f"tandem:keys:{record.key_id}"))  # type: ignore[attr-defined]
    # tdm_<id>_<secret>: the secret (token_urlsafe, which may itself hold "_") is never stored
    secret = key.split("_", 2)[2]
    assert key not in dump and secret not in dump


def test_validation_error_names_field_and_value(base_url: str, api_key: str) -> None:
    resp = httpx.post(f"{base_url}/v1/items", json={"name": "a", "size": 99}, headers=auth(api_key))
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "size" and "99" in err["message"] and err["type"] == "invalid_request_error"


def test_malformed_json_is_400(base_url: str, api_key: str) -> None:
    resp = httpx.post(
        f"{base_url}/v1/items",
        content=b'{"name": "a", ',
        headers={**auth(api_key), "content-type": "application/json"},
    )
    assert resp.status_code == 400
    assert "JSON" in resp.json()["error"]["message"]


def test_unknown_route_and_bug_keep_the_shape(base_url: str, api_key: str) -> None:
    resp = httpx.get(f"{base_url}/nope")
    assert resp.status_code == 404 and set(resp.json()["error"]) == {"type", "message", "param", "code"}
    boom = httpx.get(f"{base_url}/v1/boom", headers=auth(api_key))
    assert boom.status_code == 500 and boom.json()["error"]["type"] == "internal_error"
    assert "a bug" not in boom.text  # internals stay in the log


def test_request_id_generated_echoed_and_passed_on(redis_url: str, api_key: str) -> None:
    with (
        serve_app(build_app(redis_url)) as downstream,
        serve_app(build_app(redis_url, downstream)) as upstream,
    ):
        resp = httpx.get(f"{upstream}/v1/rid", headers=auth(api_key))
        generated = resp.headers["x-request-id"]
        assert len(generated) == 32 and resp.json()["request_id"] == generated
        resp = httpx.get(f"{upstream}/v1/forward", headers={**auth(api_key), "X-Request-ID": "trace-123"})
        assert resp.headers["x-request-id"] == "trace-123"
        assert resp.json()["request_id"] == "trace-123"  # seen by the downstream service


def test_metrics_count_routes(base_url: str, api_key: str) -> None:
    httpx.get(f"{base_url}/v1/items/zzz", headers=auth(api_key))
    text = httpx.get(f"{base_url}/metrics").text
    assert 'route="/v1/items/{name}"' in text and 'status="404"' in text
    assert "tandem_http_request_duration_seconds_bucket" in text


def test_readiness_reports_failing_dependency() -> None:
    app = create_service_app("demo", CommonSettings(redis_url="redis://127.0.0.1:1/0"))
    with serve_app(app) as url:
        resp = httpx.get(f"{url}/readyz")
        assert resp.status_code == 503
        assert resp.json()["checks"]["redis"] != "ok"


def test_field_named_like_a_location_is_still_named() -> None:
    from fastapi.exceptions import RequestValidationError

    from services.common.errors import describe_validation_error

    exc = RequestValidationError(
        [{"type": "string_too_short", "loc": ("body", "query"), "msg": "too short", "input": ""}]
    )
    message, param = describe_validation_error(exc)
    assert param == "query" and message.startswith("query:")
