"""`tandem status` / `down` / `up` on the processes of a stack: a supervisor killed with SIGKILL,
its component left behind (where no parent-death signal exists), and files that lie.

Components here are small real processes (a TCP listener with a child of its own) started the
way `tandem up` starts every component (stack.start_component: a supervisor per component);
tests/cli/test_supervisor_kill_e2e.py does the same on the whole stack."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.cli import procs
from services.cli.stack import Component, Layout, pid_alive, port_free, start_component
from services.cli.supervise import SupervisedState, error_line, read_state
from tests.helpers.servers import free_port
from tests.helpers.stack import isolated_stack_env
from tests.helpers.waiting import wait_until

TANDEM = [sys.executable, "-m", "services.cli.main"]

# Listens on PORT, starts a child of its own (in its process group), and ignores SIGTERM when
# told to: a component `tandem down` has to kill the hard way.
LISTENER = """
import signal, socket, subprocess, sys, time
if sys.argv[2] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("child", kid.pid, flush=True)
time.sleep(600)
"""


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "home"
    Layout(home).make()
    yield home
    # whatever a failing test left: the stack's own `down`
    subprocess.run([*TANDEM, "down", "--grace", "1"], env=isolated_stack_env(home), capture_output=True)


def start(home: Path, name: str, port: int, death: str = "KILL", stubborn: bool = False) -> int:
    """The pid of component ``name``, started under its supervisor and listening on ``port``."""
    layout = Layout(home)
    env = {**isolated_stack_env(home), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-c", LISTENER, str(port), "stubborn" if stubborn else "polite"]
    start_component(layout, Component(name, argv, port=port, death_signal=death), env)
    wait_until(lambda: not port_free("127.0.0.1", port), 30, f"{name} listens on {port}")

    def recorded() -> SupervisedState | None:
        state = read_state(layout.supervised_state(name))
        return state if state is not None and state.pid else None

    state = wait_until(recorded)
    assert state is not None and state.pid is not None and state.pid_start == procs.start_time(state.pid)
    return state.pid


def grandchild(home: Path, name: str) -> int:
    log = Layout(home).log_file(name)

    def line() -> str:
        return next((ln for ln in log.read_text().splitlines() if ln.startswith("child ")), "")

    return int(wait_until(line).split()[1])


def tandem(home: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**isolated_stack_env(home), "COLUMNS": "250", **(env or {})}
    return subprocess.run([*TANDEM, *args], env=env, capture_output=True, text=True, timeout=120)


def record_ports(home: Path, ports: dict[str, int]) -> None:
    import json

    (home / "run" / "stack.json").write_text(json.dumps({"urls": {}, "ports": ports}))


@pytest.mark.e2e
def test_a_component_dies_with_its_supervisor_in_its_own_group(home: Path) -> None:
    port = free_port()
    pid = start(home, "web", port)
    supervisor = int(Layout(home).pid_file("web").read_text())
    info = procs.info(pid)
    assert info is not None and info.pgid == pid != supervisor  # a group of its own
    kid = grandchild(home, "web")
    os.kill(supervisor, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), 10, "the component dies with its supervisor")
    assert port_free("127.0.0.1", port)
    # its own child was in its group: `tandem status` sees it, `tandem down` stops it
    status = tandem(home, "status")
    assert status.returncode == 1, status.stdout
    assert f"the supervisor of web (pid {supervisor}) is gone" in status.stdout
    assert "supervisor gone" in status.stdout
    down = tandem(home, "down")
    assert down.returncode == 0, down.stdout
    assert "its supervisor is gone" in down.stdout and "Tandem stopped." in down.stdout
    wait_until(lambda: not pid_alive(kid), 10, "the component's child is stopped with its group")


@pytest.mark.e2e
def test_down_stops_a_component_left_without_its_supervisor_and_says_what_it_killed(home: Path) -> None:
    # no parent-death signal, as on a platform without one: the supervisor's record is what finds it
    polite, stubborn = free_port(), free_port()
    left = start(home, "left", polite, death="NONE")
    hard = start(home, "hard", stubborn, death="NONE", stubborn=True)
    kids = [grandchild(home, "left"), grandchild(home, "hard")]
    record_ports(home, {"left": polite, "hard": stubborn})
    for name in ("left", "hard"):
        os.kill(int(Layout(home).pid_file(name).read_text()), signal.SIGKILL)
    assert pid_alive(left) and pid_alive(hard)  # what the issue measured: orphans
    down = tandem(home, "down", "--grace", "2")
    assert down.returncode == 0, down.stdout
    out = down.stdout
    assert f"stopping left (pid {left}" in out and "its supervisor is gone" in out
    assert f"killed hard's process (pid {hard}) with SIGKILL" in out
    assert "left's process" not in out.split("Killed with SIGKILL:")[1]
    for pid in (left, hard, *kids):
        wait_until(lambda: not pid_alive(pid), 10, f"pid {pid} stopped")  # noqa: B023
    assert port_free("127.0.0.1", polite) and port_free("127.0.0.1", stubborn)
    assert not list((home / "run").glob("*.pid"))


@pytest.mark.e2e
def test_up_replaces_a_component_left_without_its_supervisor(home: Path) -> None:
    # the component keeps the stack's port after its supervisor died: `tandem up` stops it
    # first (else "port ... already in use"); here the rest of `up` stops at a port held by
    # someone else, so nothing else starts
    port = free_port()
    left = start(home, "inference", port, death="NONE")
    os.kill(int(Layout(home).pid_file("inference").read_text()), signal.SIGKILL)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        up = tandem(
            home,
            "up",
            env={"TANDEM_INFERENCE_PORT": str(port), "TANDEM_AGENT_PORT": str(busy.getsockname()[1])},
        )
    finally:
        busy.close()
    assert f"stopping inference (pid {left}; its supervisor is gone)" in up.stdout, up.stdout
    assert f"port {port} (inference)" not in up.stdout  # its port was freed
    assert "(agent)" in up.stdout and up.returncode == 1
    assert not pid_alive(left)


@pytest.mark.e2e
def test_files_that_lie_give_a_line_and_nothing_else_is_signalled(home: Path, tmp_path: Path) -> None:
    run = home / "run"
    gone = subprocess.Popen(["true"])
    gone.wait()
    (run / "stale.pid").write_text(str(gone.pid))
    # another program under the pid file's pid, even one with this very TANDEM_HOME
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], env={**os.environ, "TANDEM_HOME": str(home)}
    )
    try:
        (run / "reused.pid").write_text(str(other.pid))
        (run / "reused.state.json").write_text(
            SupervisedState(
                name="reused", supervisor_pid=other.pid, pid=other.pid, pid_start=1
            ).model_dump_json()
        )
        (run / "broken.state.json").write_text("{not json")
        (run / "stack.json").write_text("garbage")
        for command in (["status"], ["down"]):
            result = tandem(home, *command)
            out = result.stdout
            assert f"supervisor of stale (pid {gone.pid}) is gone ({run / 'stale.pid'} is stale)" in out, out
            assert "the supervisor of reused (pid" not in out, out
            assert f"names pid {other.pid}, now another program" in out, out
            assert "broken.state.json does not parse" in out, out
            assert "stack.json does not parse" in out, out
            assert "Traceback" not in result.stdout + result.stderr
            assert other.poll() is None  # never signalled
        # `down` cleared the stale files; lie again for `up`, which stops at a busy port
        (run / "reused.pid").write_text(str(other.pid))
        (run / "stack.json").write_text("garbage")
        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        try:
            up = tandem(home, "up", env={"TANDEM_TRAINER_PORT": str(busy.getsockname()[1])})
        finally:
            busy.close()
        assert up.returncode == 1
        assert (
            f"names pid {other.pid}, now another program" in up.stdout
            and "stack.json does not parse" in up.stdout
        )
        assert "Traceback" not in up.stdout + up.stderr
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_the_error_line_of_a_log() -> None:
    log = (
        "INFO:     Started server process [12]\n"
        "ERROR:    Traceback (most recent call last):\n"
        '  File "x.py", line 3, in build\n'
        "    raise ModelNotFound(path)\n"
        "services.inference.engine.loader.ModelNotFound: /no/model.gguf is neither a Hugging Face\n"
        "model folder nor a .gguf file\n"
        "\n"
        "ERROR:    Application startup failed. Exiting.\n"
        "[supervise] inference ended (exit 3) after 2.0s; restart 1 in 1s\n"
    )
    assert error_line(log) == (
        "services.inference.engine.loader.ModelNotFound: /no/model.gguf is neither a Hugging Face "
        "model folder nor a .gguf file"
    )
    assert error_line("ready\n# Fatal error: can't bind\nbye\n") == "# Fatal error: can't bind"
    assert error_line("") is None
