"""Several replicas of one service behind one client: which are healthy, which to use, one retry.

Health comes from each replica's ``/readyz``, probed when what is known is older than
``health_ttl_s``: in the background on an event loop (the request goes on with what is known),
inline in synchronous code (the trainer's publish), never on every request. A replica that
refuses or drops a connection is marked down at once, without waiting for its next probe.

A request goes to the healthy replica with the fewest requests in flight (round-robin among
equals). When a replica dies before it answered (connection refused or reset, or a stream that
ends before its first token), the request is sent once more to another replica: a caller never
sees half an answer from one replica followed by another's. Timeouts are not retried: a slow
replica is not a dead one, and a second copy of the request would double its load.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

from services.common.telemetry import with_trace_context
from services.common.upstream import UpstreamBroken

log = logging.getLogger("tandem.replicas")

# The request never reached the replica: safe to send again, whatever it does.
NOT_SENT: tuple[type[Exception], ...] = (httpx.ConnectError, httpx.ConnectTimeout)
# The replica went away before it answered: safe for requests without side effects.
LOST: tuple[type[Exception], ...] = (*NOT_SENT, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


def api_root(url: str) -> str:
    """``{url}/v1`` (a URL that already ends in /v1, as OpenAI's do, is kept)."""
    return url if url.endswith("/v1") else url + "/v1"


def readyz_url(url: str) -> str:
    return url.removesuffix("/v1") + "/readyz"


def died(exc: BaseException) -> bool:
    """The replica is gone (not merely slow, and not an answer it gave)."""
    return isinstance(exc, LOST) or (isinstance(exc, UpstreamBroken) and exc.truncated)


@dataclass
class Replica:
    url: str
    healthy: bool | None = None  # None: not probed yet, used as if healthy
    checked_at: float = -math.inf
    in_flight: int = 0
    detail: str = ""


class ReplicaPool:
    def __init__(
        self,
        urls: Sequence[str],
        *,
        service: str = "inference",
        health_ttl_s: float = 2.0,
        probe_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        unique = list(dict.fromkeys(u.rstrip("/") for u in urls if u.strip()))
        if not unique:
            raise ValueError(f"{service}: no replica URL given")
        self.service = service
        self.replicas = [Replica(u) for u in unique]
        self.health_ttl_s = health_ttl_s
        self.probe_timeout_s = probe_timeout_s
        self.clock = clock
        self.retries = 0  # requests sent a second time (for tests and logs)
        self._turn = 0
        self._lock = threading.Lock()
        self._probe: asyncio.Task[None] | None = None

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def _replica(self, url: str) -> Replica:
        return next(r for r in self.replicas if r.url == url)

    # -- choosing --------------------------------------------------------------------------------

    def choose(self, exclude: Sequence[str] = ()) -> str | None:
        """A healthy replica not in ``exclude`` with the fewest requests in flight; when none is
        healthy, any (its error is then the caller's answer); None when all are excluded."""
        with self._lock:
            candidates = [r for r in self.replicas if r.url not in exclude]
            if not candidates:
                return None
            live = [r for r in candidates if r.healthy is not False] or candidates
            least = min(r.in_flight for r in live)
            tied = [r for r in live if r.in_flight == least]
            self._turn += 1
            return tied[self._turn % len(tied)].url

    def observe(self, url: str, ok: bool, detail: str = "") -> None:
        with self._lock:
            r = self._replica(url)
            if r.healthy is not False and not ok:
                log.warning("%s replica %s is down: %s", self.service, url, detail)
            r.healthy, r.checked_at, r.detail = ok, self.clock(), detail

    def _busy(self, url: str, delta: int) -> None:
        with self._lock:
            self._replica(url).in_flight += delta

    def in_flight(self, url: str) -> int:
        return self._replica(url).in_flight

    # -- health ----------------------------------------------------------------------------------

    def stale(self) -> list[str]:
        """Replicas whose health is older than the TTL (none with one replica: no choice to make)."""
        if len(self.replicas) < 2:
            return []
        now = self.clock()
        with self._lock:
            return [r.url for r in self.replicas if now - r.checked_at >= self.health_ttl_s]

    def _verdict(self, url: str, resp: httpx.Response | Exception) -> None:
        if isinstance(resp, Exception):
            self.observe(url, False, f"/readyz: {type(resp).__name__}: {resp}")
        else:
            self.observe(url, resp.status_code == 200, f"/readyz answered {resp.status_code}")

    async def refresh(self) -> None:
        """Probe the stale replicas' ``/readyz`` concurrently."""

        async def probe(http: httpx.AsyncClient, url: str) -> None:
            try:
                self._verdict(url, await http.get(readyz_url(url)))
            except httpx.HTTPError as exc:
                self._verdict(url, exc)

        async with httpx.AsyncClient(timeout=self.probe_timeout_s) as http:
            await asyncio.gather(*(probe(http, url) for url in self.stale()))

    def refresh_sync(self) -> None:
        with httpx.Client(timeout=self.probe_timeout_s) as http:
            for url in self.stale():
                try:
                    self._verdict(url, http.get(readyz_url(url)))
                except httpx.HTTPError as exc:
                    self._verdict(url, exc)

    def refresh_soon(self) -> None:
        """Probe stale replicas: in a background task under an event loop, else now."""
        if not self.stale():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.refresh_sync()
            return
        running = self._probe
        if running is None or running.done() or running.get_loop() is not loop:
            self._probe = loop.create_task(self.refresh())

    def pick(self) -> str:
        """A replica for a request that is not retried here (a proxied one)."""
        self.refresh_soon()
        url = self.choose()
        assert url is not None  # nothing excluded: there is always one
        return url

    # -- requests --------------------------------------------------------------------------------

    def attempts(self, *, idempotent: bool = True) -> Iterator[Attempt]:
        """At most two attempts on different replicas; the second only when the first died
        before answering. Use each as a context manager around the whole request::

            for attempt in pool.attempts():
                with attempt:
                    return send(attempt.url)

        ``idempotent=False`` (a request with side effects) is retried only when it never
        reached the first replica."""
        self.refresh_soon()
        tried: list[str] = []
        while (url := self.choose(exclude=tried)) is not None:
            tried.append(url)
            last = len(tried) == 2 or len(tried) == len(self.replicas)
            attempt = Attempt(self, url, last=last, idempotent=idempotent)
            yield attempt
            if attempt.failure is None:
                return
            self.retries += 1
            log.warning(
                "%s replica %s failed before answering (%s); sending the request to another",
                self.service,
                url,
                type(attempt.failure).__name__,
            )


class Attempt:
    """One try of a request on one replica; see :meth:`ReplicaPool.attempts`."""

    def __init__(self, pool: ReplicaPool, url: str, *, last: bool, idempotent: bool) -> None:
        self.pool = pool
        self.url = url
        self.last = last
        self.idempotent = idempotent
        self.committed = False
        self.failure: BaseException | None = None

    def commit(self) -> None:
        """Part of the answer reached the caller: a failure from now on is not retried."""
        self.committed = True

    def __enter__(self) -> Attempt:
        self.pool._busy(self.url, 1)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        self.pool._busy(self.url, -1)
        if exc is None:
            return False
        if died(exc):
            self.pool.observe(self.url, False, f"{type(exc).__name__}: {exc}")
        retry = died(exc) if self.idempotent else isinstance(exc, NOT_SENT)
        if self.last or self.committed or not retry:
            return False
        self.failure = exc
        return True  # swallowed: the next attempt goes to another replica


def request_sync(
    pool: ReplicaPool, method: str, path: str, *, idempotent: bool = True, **kwargs: Any
) -> httpx.Response:
    """A synchronous request to ``{replica}{path}`` over the pool (httpx's keyword arguments)."""
    headers = with_trace_context(kwargs.pop("headers", None))  # the caller's trace goes on
    for attempt in pool.attempts(idempotent=idempotent):
        with attempt:
            return httpx.request(method, attempt.url + path, headers=headers, **kwargs)
    raise RuntimeError(f"{pool.service}: no replica was tried")  # attempts() always yields one


_POOLS: dict[tuple[str, ...], ReplicaPool] = {}
_POOLS_LOCK = threading.Lock()


def replica_pool(urls: Sequence[str], service: str = "inference") -> ReplicaPool:
    """The process's one pool for these URLs, so every client shares its health and load."""
    key = (service, *urls)
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = ReplicaPool(urls, service=service)
        return _POOLS[key]
