"""The whole embedded stack after `kill -9` of a component's supervisor: no orphan, nothing
acknowledged lost, `tandem up` starts only what is missing, `tandem down` leaves no listening
port, and the next `tandem up` gets the same ports. And a component that cannot start: one line
that says why, kept for `tandem status`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.cli.stack import Layout, pid_alive, port_free
from services.cli.supervise import read_state
from tests.helpers.servers import is_ready
from tests.helpers.stack import home_processes, isolated_stack_env
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.e2e
TANDEM = [sys.executable, "-m", "services.cli.main"]
PORTS = (
    "TANDEM_REDIS_PORT",
    "TANDEM_AGENT_PORT",
    "TANDEM_INFERENCE_PORT",
    "TANDEM_RETRIEVAL_PORT",
    "TANDEM_TRAINER_PORT",
)


def tandem(env: dict[str, str], *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TANDEM, *args], env={**env, "COLUMNS": "250"}, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def stack_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    env = isolated_stack_env(tmp_path_factory.mktemp("killed") / "home")
    up = tandem(env, "up", "--timeout", "600")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield env
    finally:
        tandem(env, "down", timeout=180)


def supervisors(home: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in (home / "run").glob("*.pid")}


def components(home: Path) -> dict[str, int | None]:
    out = {}
    for name in supervisors(home):
        state = read_state(Layout(home).supervised_state(name))
        out[name] = state.pid if state else None
    return out


@pytest.mark.timeout(2400)  # three starts of the whole stack, on 2 cores
def test_a_killed_supervisor_takes_its_component_and_up_restarts_only_it(stack_env: dict[str, str]) -> None:
    home = Path(stack_env["TANDEM_HOME"])
    retrieval = f"http://127.0.0.1:{stack_env['TANDEM_RETRIEVAL_PORT']}"
    key = (home / "api-key").read_text().strip()
    http = httpx.Client(base_url=retrieval, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert http.post("/v1/collections", json={"name": "kept"}).status_code in (200, 201)
    doc = {"id": "d1", "text": "The supervisor test keeps the word zqkeptword once."}
    added = http.post("/v1/collections/kept/documents", json={"documents": [doc]})
    assert added.status_code in (200, 201), added.text  # acknowledged

    before_sup, before_pid = supervisors(home), components(home)
    victim = before_pid["retrieval"]
    assert victim is not None
    os.kill(before_sup["retrieval"], signal.SIGKILL)
    wait_until(lambda: not pid_alive(victim), 10, "retrieval dies with its supervisor")
    wait_until(
        lambda: port_free("127.0.0.1", int(stack_env["TANDEM_RETRIEVAL_PORT"])), 10, "its port is free"
    )

    status = tandem(stack_env, "status", timeout=120)
    assert status.returncode == 1
    assert f"the supervisor of retrieval (pid {before_sup['retrieval']}) is gone" in status.stdout, (
        status.stdout
    )
    row = next(ln for ln in status.stdout.splitlines() if "│ retrieval" in ln)
    assert "not running" in row

    up = tandem(stack_env, "up", "--timeout", "600")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "starting retrieval (running: " in up.stdout
    after_sup, after_pid = supervisors(home), components(home)
    for name in before_sup:  # the healthy components were not touched
        if name != "retrieval":
            assert after_sup[name] == before_sup[name] and after_pid[name] == before_pid[name], name
    assert after_sup["retrieval"] != before_sup["retrieval"] and is_ready(retrieval)
    hits = http.post(
        "/v1/collections/kept/search", json={"query": "zqkeptword", "mode": "sparse", "top_k": 5}
    )
    assert [h["document_id"] for h in hits.json()["results"]] == ["d1"]  # nothing acknowledged lost

    down = tandem(stack_env, "down", timeout=180)
    assert down.returncode == 0 and "Tandem stopped." in down.stdout, down.stdout
    wait_until(lambda: home_processes(home) == [], 10, "every process of the stack exits", interval=0.2)
    assert not [p for p in after_sup.values() if pid_alive(p)]
    assert all(port_free("127.0.0.1", int(stack_env[var])) for var in PORTS)

    again = tandem(stack_env, "up", "--timeout", "600")  # the same ports, free again
    assert again.returncode == 0, again.stdout + again.stderr
    assert is_ready(retrieval)


def test_a_component_that_cannot_start_is_named_with_its_error(tmp_path: Path) -> None:
    env = isolated_stack_env(tmp_path / "home")
    env["TANDEM_INFERENCE_MODEL"] = str(tmp_path / "no-such-model.gguf")
    up = tandem(env, "up", "--timeout", "600")
    try:
        assert up.returncode == 1
        failed = [ln for ln in up.stdout.splitlines() if ln.startswith("start-up failed:")]
        assert len(failed) == 1, up.stdout
        assert failed[0].startswith("start-up failed: inference exited during start-up: ")
        assert f"ModelNotFound: {tmp_path / 'no-such-model.gguf'} is neither" in failed[0]
        assert "Traceback" not in up.stdout + up.stderr and "Retry limit exceeded" not in up.stderr
        status = tandem(env, "status", timeout=120)
        assert status.returncode == 3
        assert (
            f"last error of inference: services.inference.engine.loader.ModelNotFound: {tmp_path}"
            in status.stdout
        )
    finally:
        tandem(env, "down", timeout=180)
    assert home_processes(tmp_path / "home") == []
