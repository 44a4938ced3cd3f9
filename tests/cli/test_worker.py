"""`tandem worker --queue Q`: a machine joins a running stack (its Redis, its shared storage).

A real worker process joins the session's Valkey and answers a ping on its queue; a
machine whose TANDEM_HOME is not the stack's shared folder, one asking for a GPU queue
without a GPU, and one without a reachable Redis are stopped before Celery starts, with a
message naming the setting.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from services.cli import stack
from tests.helpers.waiting import wait_until

TANDEM = [sys.executable, "-m", "services.cli.main"]


def env_for(home: Path, redis_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    # COLUMNS: rich would wrap the messages at 80 columns off a terminal
    env.update(TANDEM_HOME=str(home), TANDEM_REDIS_URL=redis_url, TANDEM_DEVICE="cpu", COLUMNS="400")
    return env


def tandem(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TANDEM, *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.e2e
def test_worker_joins_the_stack_and_other_storage_is_refused(redis_url: str, tmp_path: Path) -> None:
    redis.Redis.from_url(redis_url).delete(stack.STORAGE_ID_KEY)  # a fresh stack in the session's Valkey
    shared = tmp_path / "shared"
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*TANDEM, "worker", "--queue", "cpu", "--name", "joined@%h"],
            env=env_for(shared, redis_url),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(
            lambda: stack.worker_ready(redis_url, "cpu", timeout=2.0)[0], 120, "the joined worker", log=log
        )
        assert (shared / "storage-id").read_text().strip() == redis.Redis.from_url(redis_url).get(
            stack.STORAGE_ID_KEY
        ).decode()
        # a second machine with a folder of its own (not the shared mount) is refused: an empty
        # one, and one that belongs to another stack
        stranger = tmp_path / "stranger"
        stranger.mkdir()
        (stranger / "storage-id").write_text("0123456789abcdef\n")
        for home, needle in [
            (tmp_path / "local", "it has no storage-id"),
            (stranger, "0123456789abcdef differs"),
        ]:
            other = tandem(env_for(home, redis_url), "worker", "--queue", "cpu")
            assert other.returncode == 1, other.stdout
            assert "is not the stack's shared storage" in other.stdout and needle in other.stdout, (
                other.stdout
            )
    finally:
        proc.terminate()  # the CLI exec'd Celery: this pid is the worker
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        proc.kill()  # a no-op once it has exited
        proc.wait()


def test_worker_refuses_a_gpu_queue_without_a_gpu_and_an_unreachable_redis(tmp_path: Path) -> None:
    env = env_for(tmp_path / "home", "redis://127.0.0.1:1/0")
    gpu = tandem(env, "worker", "--queue", "gpu")
    assert gpu.returncode == 1 and "--queue gpu needs a GPU" in gpu.stdout and "TANDEM_DEVICE" in gpu.stdout
    cpu = tandem(env, "worker", "--queue", "cpu")
    assert cpu.returncode == 1 and "TANDEM_REDIS_URL" in cpu.stdout and "does not answer PING" in cpu.stdout
    bad = tandem(env, "worker", "--queue", "tpu")
    assert bad.returncode == 1 and "--queue 'tpu' is not a queue" in bad.stdout


def test_tandem_up_runs_the_beat_in_its_io_worker_and_tandem_worker_runs_none(tmp_path: Path) -> None:
    from services.common.config import CommonSettings

    common = CommonSettings(home=tmp_path / "home")
    comps = {c.name: c for c in stack.plan(common, True, "cpu")}
    io = comps["worker-io"].argv
    assert "--beat" in io and io[io.index("--schedule") + 1] == str(
        tmp_path / "home" / "run" / "celerybeat-schedule"
    )
    assert "--beat" not in comps["worker-cpu"].argv
    assert "--beat" not in stack.worker_argv("io")  # `tandem worker --queue io` on another machine
