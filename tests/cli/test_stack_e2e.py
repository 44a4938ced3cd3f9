"""`tandem up` / `status` / `down` for real: processes, embedded Valkey, Celery workers, HTTP."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from services.cli.stack import pid_alive
from services.cli.supervise import SupervisedState, read_state
from services.common.celery_app import make_celery
from tests.helpers.servers import free_port, is_ready
from tests.helpers.stack import home_processes, isolated_stack_env
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.e2e
TANDEM = [sys.executable, "-m", "services.cli.main"]


@pytest.fixture(scope="module")
def stack_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    home = tmp_path_factory.mktemp("stack") / "home"
    env = isolated_stack_env(home)
    up = subprocess.run(
        [*TANDEM, "up", "--timeout", "600"], env=env, capture_output=True, text=True, timeout=900
    )
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        env["_UP_OUTPUT"] = up.stdout
        yield env
    finally:
        subprocess.run([*TANDEM, "down"], env=env, capture_output=True, text=True, timeout=120)


def url(env: dict[str, str], service: str) -> str:
    return f"http://127.0.0.1:{env[f'TANDEM_{service.upper()}_PORT']}"


def test_up_prints_urls_and_a_key_once(stack_env: dict[str, str]) -> None:
    home = Path(stack_env["TANDEM_HOME"])
    key = (home / "api-key").read_text().strip()
    out = stack_env["_UP_OUTPUT"]
    assert key in out
    for service in ("agent", "inference", "retrieval", "trainer"):
        assert url(stack_env, service) in out
    assert oct((home / "api-key").stat().st_mode & 0o777) == "0o600"


def test_every_service_is_ready_and_guarded(stack_env: dict[str, str]) -> None:
    key = (Path(stack_env["TANDEM_HOME"]) / "api-key").read_text().strip()
    for service in ("agent", "inference", "retrieval", "trainer"):
        base = url(stack_env, service)
        ready = httpx.get(f"{base}/readyz", timeout=10)
        assert ready.status_code == 200, ready.text
        assert httpx.get(f"{base}/v1/whoami", timeout=10).status_code == 401
        who = httpx.get(f"{base}/v1/whoami", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        body = who.json()
        assert {k: body[k] for k in ("tenant", "service", "role")} == {
            "tenant": "default",
            "service": service,
            "role": "admin",
        }, body


def test_celery_task_round_trip_through_embedded_valkey(stack_env: dict[str, str]) -> None:
    password = (Path(stack_env["TANDEM_HOME"]) / "redis-password").read_text().strip()
    port = stack_env["TANDEM_REDIS_PORT"]
    # the embedded Valkey has a password: without it, nothing
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=int(port), socket_timeout=5).ping()
    redis_url = f"redis://:{password}@127.0.0.1:{port}/0"
    app = make_celery("test-client", redis_url)
    try:
        for queue in ("io", "cpu"):
            result = app.send_task("tandem.ping", args=[{"queue": queue}], queue=queue)
            reply = result.get(timeout=60)
            assert reply["pong"] is True and reply["echo"] == {"queue": queue}
    finally:
        app.close()


def test_status_and_second_up(stack_env: dict[str, str]) -> None:
    status = subprocess.run(
        [*TANDEM, "status"], env={**stack_env, "COLUMNS": "250"}, capture_output=True, text=True, timeout=120
    )
    assert status.returncode == 0, status.stdout + status.stderr
    for name in ("redis", "agent", "inference", "retrieval", "trainer", "worker-io", "worker-cpu"):
        assert name in status.stdout
    again = subprocess.run([*TANDEM, "up"], env=stack_env, capture_output=True, text=True, timeout=120)
    assert "already running" in again.stdout


def test_keys_cli_create_and_revoke(stack_env: dict[str, str]) -> None:
    created = subprocess.run(
        [*TANDEM, "keys", "create", "--tenant", "team-b"],
        env=stack_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip().splitlines()[-1]
    headers = {"Authorization": f"Bearer {key}"}
    base = url(stack_env, "retrieval")
    assert httpx.get(f"{base}/v1/whoami", headers=headers).json()["tenant"] == "team-b"
    # the tenant's first key is its only admin: kept unless forced
    kept = subprocess.run(
        [*TANDEM, "keys", "revoke", key], env=stack_env, capture_output=True, text=True, timeout=60
    )
    assert kept.returncode == 1 and "--force" in kept.stdout + kept.stderr, kept.stdout + kept.stderr
    assert httpx.get(f"{base}/v1/whoami", headers=headers).status_code == 200
    revoked = subprocess.run(
        [*TANDEM, "keys", "revoke", key, "--force"], env=stack_env, capture_output=True, text=True, timeout=60
    )
    assert revoked.returncode == 0, revoked.stderr
    assert httpx.get(f"{base}/v1/whoami", headers=headers).status_code == 401


def test_port_in_use_is_named(tmp_path: Path) -> None:
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(
        TANDEM_HOME=str(tmp_path / "h2"), TANDEM_REDIS_PORT=str(free_port()), TANDEM_INFERENCE_PORT=str(port)
    )
    try:
        result = subprocess.run([*TANDEM, "up"], env=env, capture_output=True, text=True, timeout=120)
    finally:
        busy.close()
    assert result.returncode == 1
    assert f"port {port} (inference)" in result.stdout and "TANDEM_INFERENCE_PORT" in result.stdout
    assert home_processes(tmp_path / "h2") == []


def test_bad_setting_stops_start_up(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(TANDEM_HOME=str(tmp_path / "h3"), TANDEM_DEVICE="tpu")
    result = subprocess.run([*TANDEM, "up"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "TANDEM_DEVICE" in result.stdout


def test_demo_searches_and_answers_from_the_docs_collection(stack_env: dict[str, str]) -> None:
    # Wide enough that rich does not wrap the answer's line.
    env = {**stack_env, "COLUMNS": "400"}
    demo = subprocess.run([*TANDEM, "demo"], env=env, capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    out = demo.stdout
    assert out.count("answers for tenant default") == 4
    # the docs collection made by the first `tandem up`: README.md and docs/*.md
    assert re.search(r"\((README\.md|docs-[a-z-]+\.md), (cited|attributed|extractive)\)", out), out
    # The first impression: the default model's answer, or the answer step's, says how to start
    # the stack and where the key is kept, citing a document of the collection.
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("chat-documents '"))
    citation = re.compile(r"\s+\[\d+\] .+ \(\S+, (cited|attributed|extractive)\)$")
    cited = [i for i in range(start + 1, len(lines)) if citation.match(lines[i])]
    assert cited, out
    answer = " ".join(lines[start + 1 : cited[0]])
    assert "api-key" in answer and re.search(r"`(make|tandem) up`", answer), out


def test_a_killed_component_is_restarted_and_status_shows_it(stack_env: dict[str, str]) -> None:
    import signal

    state_file = Path(stack_env["TANDEM_HOME"]) / "run" / "retrieval.state.json"
    before = read_state(state_file)
    assert before is not None and before.pid and before.restarts == 0
    os.kill(before.pid, signal.SIGKILL)

    def restarted_and_ready() -> SupervisedState | None:
        after = read_state(state_file)
        if after and after.pid and after.pid != before.pid and is_ready(url(stack_env, "retrieval")):
            return after
        return None

    after = wait_until(restarted_and_ready, 300, "retrieval restarted by its supervisor and ready again")
    status = subprocess.run(
        [*TANDEM, "status"], env={**stack_env, "COLUMNS": "250"}, capture_output=True, text=True, timeout=120
    )
    assert status.returncode == 0, status.stdout
    row = next(line for line in status.stdout.splitlines() if "retrieval" in line)
    assert str(after.pid) in row and "killed by SIGKILL" in row and " 1 " in row


def test_down_leaves_no_process(stack_env: dict[str, str]) -> None:
    home = Path(stack_env["TANDEM_HOME"])
    # Valkey rewrites its own environ (process title), so it is followed by its pid file.
    pids = [int(p.read_text()) for p in (home / "run").glob("*.pid")]
    assert len(pids) == 7  # redis, 4 services, 2 workers
    assert len(home_processes(home)) >= 6
    down = subprocess.run([*TANDEM, "down"], env=stack_env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    wait_until(lambda: home_processes(home) == [], 10, "every process of the stack exits", interval=0.2)
    assert not [pid for pid in pids if pid_alive(pid)]
    status = subprocess.run([*TANDEM, "status"], env=stack_env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 3 and "not running" in status.stdout


def test_foreground_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    import signal

    home = tmp_path / "fg"
    env = isolated_stack_env(home)
    proc = subprocess.Popen([*TANDEM, "up", "--foreground"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "Ctrl-C stops the stack" in line:
                break
        else:
            raise AssertionError("tandem up --foreground never became ready")
        ready = httpx.get(f"http://127.0.0.1:{env['TANDEM_AGENT_PORT']}/readyz", timeout=10)
        assert ready.status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run([*TANDEM, "down"], env=env, capture_output=True, timeout=120)
    assert home_processes(home) == []
