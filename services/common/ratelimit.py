"""Per-tenant concurrency and rate limits of a service (retrieval, agent, trainer).

The guard (services/common/guard.py) asks the limiter once per authenticated HTTP request,
after the key is verified and before any body is read: a tenant over its limit gets a 429
(OpenAI's shape, code ``rate_limit_exceeded``) with ``Retry-After``, and other tenants are
untouched. Two limits, each off at 0:

- concurrency: requests of one tenant in progress at once (a streamed answer counts until
  its last byte);
- rate: a token bucket per tenant, refilled at ``requests_per_minute`` and holding at most
  ``burst`` requests.

State lives in the process: every replica applies its own limits (docs/operations.md).
Inference has its own, finer, fair share in its scheduler (batch slots and queue).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import Field

from services.common.config import ServiceSettings


@dataclass(frozen=True)
class TenantLimits:
    max_concurrent: int = 0
    requests_per_minute: float = 0.0
    burst: int = 1


@dataclass(frozen=True)
class Refusal:
    message: str
    retry_after: int  # whole seconds, at least 1 (the header's unit)


@dataclass
class _Bucket:
    tokens: float
    at: float
    running: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class TenantLimiter:
    def __init__(
        self, limits: TenantLimits, service: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits
        self.service = service
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}
        # the guard runs on one event loop, but a lock keeps it right from threads too
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.limits.max_concurrent > 0 or self.limits.requests_per_minute > 0

    def acquire(self, tenant: str) -> Refusal | None:
        """Take a slot for one request of ``tenant``: None if admitted (then ``release``
        once it is done), else why not and when to retry."""
        lim = self.limits
        now = self.clock()
        with self._lock:
            b = self._buckets.get(tenant)
            if b is None:
                b = self._buckets[tenant] = _Bucket(tokens=float(max(1, lim.burst)), at=now)
            rate = lim.requests_per_minute / 60.0
            if rate > 0:
                b.tokens = min(float(max(1, lim.burst)), b.tokens + (now - b.at) * rate)
                b.at = now
            if lim.max_concurrent > 0 and b.running >= lim.max_concurrent:
                return Refusal(
                    f"tenant {tenant!r} has {b.running} requests in progress on the {self.service} "
                    f"service, its limit is {lim.max_concurrent}; retry when one finishes",
                    1,
                )
            if rate > 0 and b.tokens < 1.0:
                wait = (1.0 - b.tokens) / rate
                return Refusal(
                    f"tenant {tenant!r} is over its rate of {lim.requests_per_minute:g} requests a minute "
                    f"(burst {lim.burst}) on the {self.service} service; retry in {wait:.1f} s",
                    max(1, math.ceil(wait)),
                )
            if rate > 0:
                b.tokens -= 1.0
            b.running += 1
            return None

    def release(self, tenant: str) -> None:
        with self._lock:
            b = self._buckets.get(tenant)
            if b is not None and b.running > 0:
                b.running -= 1


class TenantLimitSettings(ServiceSettings):
    """The per-tenant limits a service's settings carry (``TANDEM_<SERVICE>_TENANT_*``)."""

    tenant_max_concurrent: int = Field(
        32,
        ge=0,
        le=100_000,
        description="Requests of one tenant in progress at once on this service (per replica); beyond it "
        "that tenant gets 429 with Retry-After. 0: no limit.",
    )
    tenant_requests_per_minute: float = Field(
        1200,
        ge=0,
        le=10_000_000,
        description="Sustained requests a minute of one tenant on this service (per replica, token bucket); "
        "beyond it 429 with Retry-After. 0: no limit.",
    )
    tenant_burst: int = Field(
        200, ge=1, le=1_000_000, description="Requests one tenant may make at once above its per-minute rate."
    )

    def tenant_limits(self) -> TenantLimits:
        return TenantLimits(self.tenant_max_concurrent, self.tenant_requests_per_minute, self.tenant_burst)
