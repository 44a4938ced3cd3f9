"""The per-tenant rate limit of a service, checked over real HTTP (one test per service)."""

from __future__ import annotations

import importlib

import httpx
import pytest

from tests.helpers.servers import serve_app


def assert_tenant_rate_limited(
    service: str, key: str, other_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service's app with ``TANDEM_<SERVICE>_TENANT_REQUESTS_PER_MINUTE=1`` and burst 1:
    the tenant's second request is a 429 in OpenAI's shape with Retry-After; another tenant
    is served."""
    monkeypatch.setenv(f"TANDEM_{service.upper()}_TENANT_REQUESTS_PER_MINUTE", "1")
    monkeypatch.setenv(f"TANDEM_{service.upper()}_TENANT_BURST", "1")
    create_app = importlib.import_module(f"services.{service}.app").create_app
    with serve_app(create_app()) as url, httpx.Client(base_url=url, timeout=60) as c:
        first = c.get("/v1/whoami", headers={"Authorization": f"Bearer {key}"})
        assert first.status_code == 200, first.text
        second = c.get("/v1/whoami", headers={"Authorization": f"Bearer {key}"})
        assert second.status_code == 429, second.text
        # one request a minute: the next token is up to a minute away
        assert 1 <= int(second.headers["Retry-After"]) <= 60
        err = second.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
        assert "'acme'" in err["message"] and service in err["message"]
        other = c.get("/v1/whoami", headers={"Authorization": f"Bearer {other_key}"})
        assert other.status_code == 200, other.text
        # public routes are not counted
        assert c.get("/healthz").status_code == 200
