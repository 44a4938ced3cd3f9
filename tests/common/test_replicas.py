"""The replica pool: which replica a request goes to, when health is probed (an injected clock,
no sleeps), and the one retry on another replica when one dies before answering."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from services.common.config import CommonSettings, SettingsError, load_settings
from services.common.replicas import ReplicaPool, api_root, readyz_url, request_sync
from services.common.upstream import UpstreamBroken
from tests.helpers.servers import free_port, serve_app

A, B, C = "http://a.invalid:1", "http://b.invalid:2", "http://c.invalid:3"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool_of(*urls: str, clock: Clock | None = None) -> ReplicaPool:
    """A pool whose replicas were all just seen healthy, so nothing is probed until the clock moves."""
    clock = clock or Clock()
    pool = ReplicaPool(list(urls), health_ttl_s=2.0, clock=clock)
    for url in urls:
        pool.observe(url, True)
    return pool


def test_spreads_over_healthy_replicas_by_load_then_in_turn() -> None:
    pool = pool_of(A, B, C)
    assert {pool.choose() for _ in range(6)} == {A, B, C}
    pool.observe(B, False, "refused")
    assert {pool.choose() for _ in range(6)} == {A, C}
    # the one with fewer requests in flight wins
    with next(pool.attempts()) as busy:
        other = ({A, C} - {busy.url}).pop()
        assert [pool.choose() for _ in range(3)] == [other] * 3
    assert pool.in_flight(busy.url) == 0


def test_all_down_still_answers_with_one_and_exclusion_is_respected() -> None:
    pool = pool_of(A, B)
    pool.observe(A, False)
    pool.observe(B, False)
    # nothing healthy: a replica is still tried (its error is then the caller's answer)
    assert pool.choose() in (A, B)
    assert pool.choose(exclude=[A]) == B
    assert pool.choose(exclude=[A, B]) is None


def test_health_is_probed_only_when_older_than_the_ttl() -> None:
    clock = Clock()
    pool = pool_of(A, B, clock=clock)
    assert pool.stale() == []
    clock.now += 1.99
    assert pool.stale() == []
    clock.now += 0.01
    assert pool.stale() == [A, B]
    pool.observe(A, True)
    assert pool.stale() == [B]
    # one replica: no choice to make, so it is never probed
    single = ReplicaPool([A], clock=clock)
    clock.now += 1000
    assert single.stale() == []


def request(
    pool: ReplicaPool, failures: list[BaseException], *, idempotent: bool = True, commit: bool = False
) -> list[str]:
    """One request through the pool; its n-th try raises ``failures[n]`` (none left: it
    succeeds). Returns the replicas tried; an error that is not retried propagates."""
    tried: list[str] = []
    for attempt in pool.attempts(idempotent=idempotent):
        with attempt:
            tried.append(attempt.url)
            if commit:
                attempt.commit()  # part of the answer reached the caller
            if len(tried) <= len(failures):
                raise failures[len(tried) - 1]
    return tried


def test_a_replica_that_refuses_is_marked_down_and_the_request_goes_to_another() -> None:
    pool = pool_of(A, B)
    tried = request(pool, [httpx.ConnectError("connection refused")])
    assert len(tried) == 2 and tried[0] != tried[1]
    assert pool.retries == 1
    first = next(r for r in pool.replicas if r.url == tried[0])
    assert first.healthy is False and "ConnectError" in first.detail
    # the next requests avoid it without waiting for a probe
    assert {pool.choose() for _ in range(4)} == {tried[1]}


@pytest.mark.parametrize(
    "exc",
    [
        httpx.ReadError("connection reset"),
        httpx.RemoteProtocolError("peer closed connection"),
        UpstreamBroken("the stream ended before [DONE]", truncated=True),
    ],
)
def test_death_before_answering_is_retried_once(exc: Exception) -> None:
    pool = pool_of(A, B)
    assert len(set(request(pool, [exc]))) == 2 and pool.retries == 1
    with pytest.raises(type(exc)):
        request(pool, [exc, exc, exc])
    # never a third try, and both replicas are now marked down
    assert pool.retries == 2
    assert [r.healthy for r in pool.replicas] == [False, False]


def test_what_is_not_a_death_is_not_retried() -> None:
    pool = pool_of(A, B)
    for exc in (
        httpx.ReadTimeout("slow"),  # slow is not dead; a copy would double its load
        UpstreamBroken("model not found"),  # an answer, not a death
        ValueError("a bug"),
    ):
        with pytest.raises(type(exc)):
            request(pool, [exc])
    assert pool.retries == 0 and [r.healthy for r in pool.replicas] == [True, True]


def test_after_the_first_token_nothing_is_retried() -> None:
    pool = pool_of(A, B)
    with pytest.raises(httpx.ReadError):
        request(pool, [httpx.ReadError("connection reset")], commit=True)
    assert pool.retries == 0


def test_a_request_with_side_effects_is_retried_only_if_it_never_arrived() -> None:
    pool = pool_of(A, B)
    with pytest.raises(httpx.ReadError):
        request(pool, [httpx.ReadError("reset after the body was sent")], idempotent=False)
    assert len(request(pool, [httpx.ConnectError("refused")], idempotent=False)) == 2


def test_urls() -> None:
    assert api_root("http://x:1") == "http://x:1/v1"
    assert api_root("https://api.example.com/v1") == "https://api.example.com/v1"
    assert readyz_url("http://x:1/v1") == readyz_url("http://x:1") == "http://x:1/readyz"
    assert ReplicaPool(["http://x:1/", "http://x:1", " "]).urls == ["http://x:1"]
    with pytest.raises(ValueError, match="no replica"):
        ReplicaPool([])


def test_settings_inference_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    assert CommonSettings(inference_url="http://one:8001/").inference_replicas() == ["http://one:8001"]
    both = CommonSettings(inference_url="http://one:8001", inference_urls=" http://a:1/, http://b:2 ,")
    assert both.inference_replicas() == ["http://a:1", "http://b:2"]
    monkeypatch.setenv("TANDEM_INFERENCE_URLS", "http://a:1,b:2")
    with pytest.raises(SettingsError, match=r"TANDEM_INFERENCE_URLS: .*'b:2'"):
        load_settings(CommonSettings, check_unknown=False)


# -- /readyz over real HTTP --------------------------------------------------------------------


def readiness_app(status: int, gate: threading.Event | None = None) -> FastAPI:
    app = FastAPI()

    @app.get("/readyz")
    def readyz() -> JSONResponse:  # sync: runs in a thread, so waiting on the gate blocks no loop
        if gate is not None:
            gate.wait(30)
        return JSONResponse({"status": "ready" if status == 200 else "not_ready"}, status_code=status)

    return app


@pytest.fixture(scope="module")
def ready_and_not() -> Iterator[tuple[str, str]]:
    with serve_app(readiness_app(200)) as ready, serve_app(readiness_app(503)) as not_ready:
        yield ready, not_ready


def test_probes_readyz_and_sends_nothing_to_a_replica_not_ready(ready_and_not: tuple[str, str]) -> None:
    ready, not_ready = ready_and_not
    dead = f"http://127.0.0.1:{free_port()}"
    pool = ReplicaPool([ready, not_ready, dead], probe_timeout_s=5)
    pool.refresh_sync()
    assert [r.healthy for r in pool.replicas] == [True, False, False]
    assert "503" in pool.replicas[1].detail and "ConnectError" in pool.replicas[2].detail
    assert {pool.choose() for _ in range(6)} == {ready}
    # synchronous callers (the trainer) go through the same pool; /readyz stands in for a route
    assert request_sync(pool, "GET", "/readyz", timeout=5).status_code == 200


def test_under_an_event_loop_the_probe_runs_in_the_background() -> None:
    gate = threading.Event()

    async def main(slow: str, other: str) -> None:
        pool = ReplicaPool([slow, other], probe_timeout_s=30)
        try:
            # the request is not held up by the probe: a replica is chosen while /readyz hangs
            assert pool.pick() in (slow, other)
            probe = pool._probe
            assert probe is not None and not probe.done()
            assert [r.healthy for r in pool.replicas] == [None, None]
            pool.pick()
            assert pool._probe is probe  # one probe at a time
        finally:
            gate.set()
        await probe
        assert [r.healthy for r in pool.replicas] == [True, True]

    with serve_app(readiness_app(200, gate)) as slow, serve_app(readiness_app(200)) as other:
        asyncio.run(main(slow, other))
