"""The supervisor that `tandem up` runs every component under: restarts with backoff, state file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from services.cli.stack import pid_alive
from services.cli.supervise import Backoff, Child, Supervisor, backoff_of, read_state
from services.common.config import SettingsError
from tests.helpers.waiting import wait_until


def test_backoff_doubles_up_to_its_maximum_and_resets_after_a_long_run() -> None:
    b = Backoff(initial=1, factor=2, maximum=5, reset_after=60)
    delays = []
    d: float | None = None
    for _ in range(5):
        d = b.delay(d, ran_for=0.5)
        delays.append(d)
    assert delays == [1, 2, 4, 5, 5]
    assert b.delay(5, ran_for=61) == 1  # a run that lasted is a fresh start


def test_the_longest_backoff_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert backoff_of(None).maximum == 30.0  # the default, as compose's restart policy roughly waits
    monkeypatch.setenv("TANDEM_SUPERVISE_BACKOFF_MAX_S", "2.5")
    assert backoff_of(None).maximum == 2.5
    assert backoff_of(7.0).maximum == 7.0  # --backoff-max wins
    monkeypatch.setenv("TANDEM_SUPERVISE_BACKOFF_MAX_S", "-1")
    with pytest.raises(SettingsError, match="SUPERVISE_BACKOFF_MAX_S"):
        backoff_of(None)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_crashing_component_is_restarted_with_growing_delays(tmp_path: Path) -> None:
    clock = FakeClock()
    waited: list[float] = []
    runs_for = [0.5, 0.5, 120.0, 0.5]  # the third run is long: the backoff starts over

    def wait(seconds: float) -> None:
        waited.append(seconds)
        clock.now += seconds

    def spawn(argv: Sequence[str]) -> Child:
        # a real process that fails at once; the fake clock says how long it "ran"
        proc = subprocess.Popen(list(argv))
        clock.now += runs_for[len(waited)]
        return proc

    state_file = tmp_path / "c.state.json"
    sup = Supervisor(
        "c",
        [sys.executable, "-c", "raise SystemExit(3)"],
        state_file,
        Backoff(initial=1, factor=2, maximum=30, reset_after=60),
        spawn=spawn,
        clock=clock,
        wait=wait,
    )
    assert sup.run(max_runs=4) == 3
    assert waited == [1, 2, 1, 2]
    state = read_state(state_file)
    assert state is not None
    assert state.restarts == 4 and state.last_exit == 3 and state.pid is None
    assert state.last_exit_text() == "exit 3"


def test_kill_9_of_the_component_restarts_it_and_sigterm_stops_everything(tmp_path: Path) -> None:
    state_file = tmp_path / "svc.state.json"
    sup = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli.supervise",
            "--name",
            "svc",
            "--state",
            str(state_file),
            "--",
            sys.executable,
            "-c",
            "import time; time.sleep(600)",
        ],
        start_new_session=True,  # as tandem up starts it: the supervisor leads the group
    )
    try:
        first = wait_until(lambda: (s := read_state(state_file)) and s.pid and s)
        assert first.supervisor_pid == sup.pid and first.restarts == 0
        os.kill(first.pid, signal.SIGKILL)
        second = wait_until(lambda: (s := read_state(state_file)) and s.pid and s.restarts == 1 and s)
        assert second.pid != first.pid and pid_alive(second.pid)
        assert second.last_exit == -signal.SIGKILL
        assert second.last_exit_text() == "killed by SIGKILL"
        os.killpg(sup.pid, signal.SIGTERM)  # what `tandem down` does
        assert sup.wait(30) == 0
        wait_until(lambda: not pid_alive(second.pid))
        final = read_state(state_file)
        assert final is not None and final.stopping and final.restarts == 1
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)


def test_no_command_is_a_usage_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.cli.supervise", "--name", "x", "--state", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "no command to supervise" in result.stderr


@pytest.mark.parametrize("code,text", [(0, "exit 0"), (-15, "killed by SIGTERM"), (None, "-")])
def test_last_exit_text(code: int | None, text: str) -> None:
    from services.cli.supervise import SupervisedState

    assert SupervisedState(name="n", supervisor_pid=1, last_exit=code).last_exit_text() == text


def test_the_last_error_is_the_exception_of_the_run_that_ended(tmp_path: Path) -> None:
    log = tmp_path / "c.log"
    log.write_text("Traceback (most recent call last):\nOldError: from an earlier run\n")
    runs = iter(["raise ValueError('TANDEM_X=3 is not a size')", "import os; os.kill(os.getpid(), 9)"])

    def spawn(argv: Sequence[str]) -> Child:
        with log.open("ab") as out:  # the component's output goes to its log, as under tandem up
            return subprocess.Popen([sys.executable, "-c", next(runs)], stdout=out, stderr=subprocess.STDOUT)

    state_file = tmp_path / "c.state.json"
    sup = Supervisor(
        "c", ["unused"], state_file, spawn=spawn, clock=FakeClock(), wait=lambda s: None, log=log
    )
    sup.run(max_runs=1)
    first = read_state(state_file)
    assert first is not None and first.last_error == "ValueError: TANDEM_X=3 is not a size"
    sup.run(max_runs=1)
    second = read_state(state_file)
    assert second is not None and second.last_error == "killed by SIGKILL"


def test_a_supervised_component_runs_in_a_group_of_its_own(tmp_path: Path) -> None:
    from services.cli.supervise import spawn_owned

    child = spawn_owned([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert os.getpgid(child.pid) == child.pid != os.getpgid(0)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
