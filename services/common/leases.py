"""Job leases: which worker runs a job now, kept alive by its heartbeat.

Used by training jobs (services/trainer) and ingestion jobs (services/retrieval). A Celery
task may be delivered twice (a recovered job, then the original unacked message once the
broker's visibility timeout passes), so a worker first takes the job's lease and leaves the
job alone when another live worker holds it. A worker killed with ``kill -9`` stops renewing
its lease; once it has expired, a recovery scan puts the job back on its queue (exactly one
scanner per attempt, through ``claim_requeue``) instead of waiting days for the broker.

A lease expires at ``expires`` on the store's clock (not by Redis' own TTL), so a test moves
the clock instead of sleeping past it; the default clock is the Redis server's time, one
clock for every worker whatever their own say. Redis still drops a dead lease's key an hour
after it expired.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import cast

import redis
from pydantic import Field

from services.common.config import ServiceSettings

log = logging.getLogger("tandem.leases")


class JobLeaseSettings(ServiceSettings):
    """How a service's workers keep their jobs' leases (``TANDEM_<SERVICE>_HEARTBEAT_INTERVAL_S``...)."""

    heartbeat_interval_s: float = Field(
        5.0, gt=0, description="How often a running job renews its lease (heartbeat) in Redis."
    )
    stale_after_s: float = Field(
        30.0,
        gt=0,
        description="A running job whose lease was not renewed for this long is taken as orphaned (its worker died) and requeued.",
    )
    recovery_interval_s: float = Field(
        15.0, gt=0, description="How often each worker scans for orphaned jobs to requeue."
    )
    max_recoveries: int = Field(
        3, ge=0, description="How many times a job is requeued after its worker died before it is failed."
    )


LEASE_GC_MS = 3_600_000
# ARGV: owner, now (ms), ttl (ms), gc (ms). Taken only when nobody holds a live lease.
_ACQUIRE = """
local expires = tonumber(redis.call('hget', KEYS[1], 'expires') or '0')
if expires > tonumber(ARGV[2]) then return 0 end
redis.call('hset', KEYS[1], 'owner', ARGV[1], 'expires', tonumber(ARGV[2]) + tonumber(ARGV[3]))
redis.call('pexpire', KEYS[1], tonumber(ARGV[3]) + tonumber(ARGV[4]))
return 1
"""
# Refresh the lease only while we still own it and it has not expired (a recovered job may have
# a new owner).
_RENEW = """
if redis.call('hget', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
if tonumber(redis.call('hget', KEYS[1], 'expires') or '0') <= tonumber(ARGV[2]) then return 0 end
redis.call('hset', KEYS[1], 'expires', tonumber(ARGV[2]) + tonumber(ARGV[3]))
redis.call('pexpire', KEYS[1], tonumber(ARGV[3]) + tonumber(ARGV[4]))
return 1
"""

Clock = Callable[[], float]  # seconds


def redis_clock(client: redis.Redis) -> Clock:
    """The Redis server's time: one clock for every worker, whatever their own clocks say."""

    def now() -> float:
        sec, usec = client.time()
        return sec + usec / 1e6

    return now


class Leases:
    """The leases of one service's jobs, under ``<prefix>job:<id>:lease`` (a hash of owner and
    expires, in ms on ``clock``)."""

    def __init__(self, client: redis.Redis, prefix: str, clock: Clock | None = None) -> None:
        self.r = client
        self.prefix = prefix
        self.clock = clock or redis_clock(client)

    def key(self, job_id: str) -> str:
        return f"{self.prefix}job:{job_id}:lease"

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    def acquire(self, job_id: str, owner: str, ttl_s: float) -> bool:
        args = (owner, self._now_ms(), int(ttl_s * 1000), LEASE_GC_MS)
        return bool(self.r.eval(_ACQUIRE, 1, self.key(job_id), *args))

    def renew(self, job_id: str, owner: str, ttl_s: float) -> bool:
        args = (owner, self._now_ms(), int(ttl_s * 1000), LEASE_GC_MS)
        return bool(self.r.eval(_RENEW, 1, self.key(job_id), *args))

    def release(self, job_id: str, owner: str) -> None:
        if self.r.hget(self.key(job_id), "owner") == owner:
            self.r.delete(self.key(job_id))

    def owner(self, job_id: str) -> str | None:
        """Who holds a live lease on the job, or None when nobody does (or it expired)."""
        owner, expires = cast(list[str | None], self.r.hmget(self.key(job_id), ["owner", "expires"]))
        if owner is None or int(expires or 0) <= self._now_ms():
            return None
        return str(owner)

    def claim_requeue(self, job_id: str, attempt: int) -> bool:
        """Only one scanner requeues a given orphaned attempt."""
        key = f"{self.prefix}job:{job_id}:requeue:{attempt}"
        return bool(self.r.set(key, "1", nx=True, ex=24 * 3600))


class Heartbeat:
    """Renews ``owner``'s lease on ``job_id`` every ``interval_s`` while the job runs.

    A lease that expired (a long stall) but that nobody took over is taken back; one held by
    someone else means a recovered copy runs the job now, and ``lost`` is set so this one
    stops. ``on_beat(reacquired)`` runs after each renewal (to stamp the job's hash)."""

    def __init__(
        self,
        leases: Leases,
        job_id: str,
        owner: str,
        ttl_s: float,
        interval_s: float,
        on_beat: Callable[[bool], object] | None = None,
    ) -> None:
        self.leases, self.job_id, self.owner = leases, job_id, owner
        self.ttl_s, self.interval_s, self.on_beat = ttl_s, interval_s, on_beat
        self.stop = threading.Event()
        self.lost = threading.Event()
        self.thread = threading.Thread(target=self._beat, name=f"heartbeat-{job_id}", daemon=True)

    def _beat(self) -> None:
        while not self.stop.wait(self.interval_s):
            try:
                reacquired = False
                if not self.leases.renew(self.job_id, self.owner, self.ttl_s):
                    if not self.leases.acquire(self.job_id, self.owner, self.ttl_s):
                        self.lost.set()
                        return
                    reacquired = True
                    log.warning("job %s: heartbeat lease had expired; re-acquired", self.job_id)
                if self.on_beat is not None:
                    self.on_beat(reacquired)
            except Exception:  # a Redis blip: try again next beat; the TTL covers a few misses
                log.warning("heartbeat of %s failed", self.job_id, exc_info=True)

    def __enter__(self) -> Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)


def recovery_loop(scan: Callable[[], list[str]], interval_s: float, stop: threading.Event, what: str) -> None:
    """Run ``scan`` (which requeues orphaned jobs and returns their ids) now and then every
    ``interval_s`` until ``stop`` is set: the body of a worker's recovery thread."""
    while True:
        try:
            found = scan()
            if found:
                log.warning("requeued orphaned %s: %s", what, ", ".join(found))
        except Exception:  # Redis away for a moment: the next scan tries again
            log.exception("orphan recovery of %s failed", what)
        if stop.wait(interval_s):
            return
