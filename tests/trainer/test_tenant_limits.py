"""The trainer applies the per-tenant rate limit (429 with Retry-After)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tenant_limits import assert_tenant_rate_limited


def test_trainer_tenant_rate_limit(
    tandem_env: Path, api_key: str, other_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_tenant_rate_limited("trainer", api_key, other_key, monkeypatch)
