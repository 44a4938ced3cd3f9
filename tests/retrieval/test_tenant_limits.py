"""Retrieval applies the per-tenant rate limit (429 with Retry-After)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.servers import serve_app
from tests.helpers.tenant_limits import assert_tenant_rate_limited


def test_retrieval_tenant_rate_limit(
    retrieval_env: Path, api_key: str, other_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.retrieval.app import create_app

    monkeypatch.setenv("TANDEM_RETRIEVAL_TENANT_REQUESTS_PER_MINUTE", "1")
    monkeypatch.setenv("TANDEM_RETRIEVAL_TENANT_BURST", "1")
    with serve_app(create_app()) as url:
        assert_tenant_rate_limited(url, api_key, other_key, "retrieval")
