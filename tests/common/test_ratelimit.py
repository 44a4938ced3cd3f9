"""The per-tenant limiter the guard applies (retrieval, agent, trainer), on an injected clock."""

from __future__ import annotations

from services.common.ratelimit import TenantLimiter, TenantLimits


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_concurrency_limit_is_per_tenant_and_released() -> None:
    lim = TenantLimiter(TenantLimits(max_concurrent=2), "agent", Clock())
    assert lim.acquire("a") is None and lim.acquire("a") is None
    refusal = lim.acquire("a")
    assert refusal is not None and refusal.retry_after >= 1 and "limit is 2" in refusal.message
    assert lim.acquire("b") is None  # another tenant is untouched
    lim.release("a")
    assert lim.acquire("a") is None


def test_token_bucket_refills_at_the_rate() -> None:
    clock = Clock()
    lim = TenantLimiter(TenantLimits(requests_per_minute=60, burst=2), "retrieval", clock)
    for _ in range(2):
        assert lim.acquire("a") is None
        lim.release("a")
    refusal = lim.acquire("a")
    assert refusal is not None and refusal.retry_after == 1 and "60 requests a minute" in refusal.message
    clock.now += 1.0  # one request a second
    assert lim.acquire("a") is None
    assert lim.acquire("a") is not None


def test_zero_is_no_limit() -> None:
    lim = TenantLimiter(TenantLimits(0, 0, 1), "trainer", Clock())
    assert not lim.enabled
    assert all(lim.acquire("a") is None for _ in range(1000))
