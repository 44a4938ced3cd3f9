"""Two real inference processes behind the shared client; one is killed with SIGKILL while many
requests are in flight, and every request still gets an answer from the other.

A request the dead replica had not started answering (queued, or non-streamed, so the caller had
seen nothing of it) is sent once to the other replica. A stream that had already passed tokens to
its caller cannot be finished elsewhere (another replica would start the answer again): those
few (at most the dead replica's batch size) end in an upstream error, which the test checks is
what happened to them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.agent.clients import ChatRequest, InferenceClient
from services.common.errors import UpstreamError
from services.common.replicas import ReplicaPool
from tests.conftest import REPO_ROOT
from tests.helpers.servers import free_port
from tests.helpers.waiting import wait_until

BATCH = 2  # sequences each replica decodes at once: the rest of its requests wait in its queue
TOKENS = 24


def start_replica(env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "uvicorn", "services.inference.app:create_app", "--factory",
           "--host", "127.0.0.1", "--port", str(port), "--no-access-log"]  # fmt: skip
    with log.open("ab") as out:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture()
def replicas(
    tmp_path: Path, redis_url: str, tiny_model_path: Path
) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(
        TANDEM_HOME=str(tmp_path / "home"),
        TANDEM_REDIS_URL=redis_url,
        TANDEM_LOG_JSON="false",
        TANDEM_DEVICE="cpu",
        TANDEM_INFERENCE_MODEL=str(tiny_model_path),
        TANDEM_INFERENCE_SERVED_MODEL_NAME="tiny",
        TANDEM_INFERENCE_MAX_BATCH_SIZE=str(BATCH),
        TANDEM_INFERENCE_MAX_MODEL_LEN="256",
        # the whole load may land on the survivor: nothing may be refused for queueing
        TANDEM_INFERENCE_MAX_QUEUE="1000",
        TANDEM_INFERENCE_TENANT_MAX_QUEUED="1000",
        TANDEM_INFERENCE_EMBEDDING_MODELS="",
        TANDEM_INFERENCE_THREADS="1",
        OMP_NUM_THREADS="1",
    )
    started = []
    try:
        for i in range(2):
            port = free_port()
            started.append(
                (f"http://127.0.0.1:{port}", start_replica(env, port, tmp_path / f"replica{i}.log"))
            )
        for i, (url, proc) in enumerate(started):
            log = tmp_path / f"replica{i}.log"
            wait_until(
                lambda u=url, p=proc: ready(u) or p.poll() is not None, 180, f"replica {i} ready", log=log
            )
            assert proc.poll() is None, log.read_text()[-3000:]
        yield started
    finally:
        for _, proc in started:  # nothing of theirs outlives the test: no graceful stop needed
            proc.kill()
            proc.wait()


@pytest.mark.e2e
def test_a_replica_killed_mid_load_loses_no_request(
    replicas: list[tuple[str, subprocess.Popen[bytes]]], api_key: str
) -> None:
    (victim, victim_proc), (survivor, _) = replicas
    pool = ReplicaPool([victim, survivor])
    client = InferenceClient(pool, api_key, timeout=300)

    def ask(text: str) -> ChatRequest:
        messages = [{"role": "user", "content": text}]
        return ChatRequest(model="tiny", messages=messages, max_tokens=TOKENS, temperature=0, ignore_eos=True)

    n_json, n_stream = 20, 12
    answered = 0

    async def whole(i: int) -> str:
        nonlocal answered
        out = await client.complete(ask(f"Question {i}"))
        answered += 1
        assert out.choices[0].finish_reason == "length"
        return out.message.content or ""

    async def streamed(i: int) -> tuple[str, Exception | None]:
        nonlocal answered
        text: list[str] = []
        try:
            async for chunk in client.stream(ask(f"Stream {i}")):
                text += [c.text for c in chunk.choices]
        except UpstreamError as exc:
            return "".join(text), exc
        answered += 1
        return "".join(text), None

    async def kill_mid_load() -> int:
        # mid-load: some answers are out, and the victim still holds requests (queued or decoding)
        deadline = time.monotonic() + 300
        while not (answered >= 2 and pool.in_flight(victim) >= 2 * BATCH):
            assert time.monotonic() < deadline, "the load never reached the victim"
            await asyncio.sleep(0.01)
        held = pool.in_flight(victim)
        os.kill(victim_proc.pid, signal.SIGKILL)
        return held

    async def main() -> tuple[list[str], list[tuple[str, Exception | None]], int]:
        killer = asyncio.create_task(kill_mid_load())
        jobs = await asyncio.gather(
            asyncio.gather(*(whole(i) for i in range(n_json))),
            asyncio.gather(*(streamed(i) for i in range(n_stream))),
        )
        return jobs[0], jobs[1], await killer

    wholes, streams, held = asyncio.run(main())
    victim_proc.wait(10)
    assert victim_proc.returncode == -signal.SIGKILL
    # the victim held several requests; those it had not started answering went to the survivor
    assert held >= 2 * BATCH and pool.retries >= 1, (held, pool.retries)
    # every non-streamed request was answered, by one replica or the other
    assert len(wholes) == n_json and all(wholes)
    # a stream fails only if the victim had already passed it tokens, at most one batch of them
    cut = [(text, exc) for text, exc in streams if exc is not None]
    assert all(text for text, _ in cut), cut
    assert len(cut) <= BATCH, cut
    assert all(text for text, exc in streams if exc is None)
    # the dead replica is known to be down: later requests go to the survivor without a retry
    assert next(r for r in pool.replicas if r.url == victim).healthy is False
    retries = pool.retries

    async def after() -> list[str]:
        return await asyncio.gather(*(whole(i) for i in range(4)))

    assert all(asyncio.run(after())) and pool.retries == retries
