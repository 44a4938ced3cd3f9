"""The per-tenant rate limit of a service, checked over real HTTP (one test per service)."""

from __future__ import annotations

import httpx


def assert_tenant_rate_limited(url: str, key: str, other_key: str, service: str) -> None:
    """With ``TANDEM_<SERVICE>_TENANT_REQUESTS_PER_MINUTE=1`` and burst 1: the tenant's
    second request is a 429 in OpenAI's shape with Retry-After; another tenant is served."""
    with httpx.Client(base_url=url, timeout=60) as c:
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
