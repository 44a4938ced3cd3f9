"""Keeps one component of the embedded stack running, as compose's ``restart`` policy does.

``tandem up`` starts every component under this supervisor::

    python -m services.cli.supervise --name retrieval --state RUN/retrieval.state.json -- ARGV...

The supervisor runs ARGV as its child in its own process group (``tandem down`` stops the group:
supervisor, component and the component's children together). When the component exits for
any reason other than being told to stop, it is started again after a backoff that doubles from
``initial`` up to ``maximum`` seconds, and goes back to ``initial`` once a run lasted
``reset_after`` seconds (a component that crashes at once is not restarted in a tight loop).

Each start and exit is written to the state file (JSON, replaced atomically): the component's
pid, its restarts, its last exit status and when. ``tandem status`` shows them, and ``tandem up``
reads them to tell a component that dies during start-up from one still starting.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Protocol

from pydantic import BaseModel


class SupervisedState(BaseModel):
    """What ``tandem status`` shows of a supervised component."""

    name: str
    supervisor_pid: int
    pid: int | None = None  # the component's own process, None between runs
    started_at: float | None = None  # wall clock of the current run's start
    restarts: int = 0
    last_exit: int | None = None  # exit status; negative: killed by that signal
    last_exit_at: float | None = None
    stopping: bool = False

    def last_exit_text(self) -> str:
        if self.last_exit is None:
            return "-"
        if self.last_exit < 0:
            try:
                return f"killed by {signal.Signals(-self.last_exit).name}"
            except ValueError:
                return f"killed by signal {-self.last_exit}"
        return f"exit {self.last_exit}"


def read_state(path: Path) -> SupervisedState | None:
    try:
        return SupervisedState.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Backoff:
    initial: float = 1.0
    factor: float = 2.0
    maximum: float = 30.0
    reset_after: float = 60.0

    def delay(self, previous: float | None, ran_for: float) -> float:
        """Seconds to wait before the next start, after a run of ``ran_for`` seconds."""
        if previous is None or ran_for >= self.reset_after:
            return self.initial
        return min(self.maximum, previous * self.factor)


class Child(Protocol):
    pid: int

    def wait(self) -> int: ...

    def send_signal(self, sig: int) -> None: ...


Spawn = Callable[[Sequence[str]], Child]


def _spawn(argv: Sequence[str]) -> Child:
    # Same process group as the supervisor (no new session): `tandem down` signals the group.
    return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, close_fds=True)


class Supervisor:
    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        state_file: Path,
        backoff: Backoff = Backoff(),
        spawn: Spawn = _spawn,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        wait: Callable[[float], None] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.state_file = state_file
        self.backoff = backoff
        self.spawn = spawn
        self.clock = clock
        self.wall = wall
        self.wait = wait or self._interruptible_sleep
        self.state = SupervisedState(name=name, supervisor_pid=os.getpid())
        self.child: Child | None = None

    def stop(self) -> None:
        """Stop supervising: the running component is asked to stop and is not started again."""
        self.state.stopping = True
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError):
                self.child.send_signal(signal.SIGTERM)

    def run(self, max_runs: int | None = None) -> int:
        """Run the component until told to stop; returns its last exit status.
        ``max_runs`` bounds the loop for tests."""
        delay: float | None = None
        runs = 0
        rc = 0
        while not self.state.stopping and (max_runs is None or runs < max_runs):
            started = self.clock()
            self.child = self.spawn(self.argv)
            runs += 1
            self.state.pid, self.state.started_at = self.child.pid, self.wall()
            self._write()
            rc = self.child.wait()
            self.child = None
            self.state.pid, self.state.last_exit, self.state.last_exit_at = None, rc, self.wall()
            if self.state.stopping:
                break
            self.state.restarts += 1
            self._write()
            delay = self.backoff.delay(delay, self.clock() - started)
            print(
                f"[supervise] {self.name} ended ({self.state.last_exit_text()}) after "
                f"{self.clock() - started:.1f}s; restart {self.state.restarts} in {delay:.0f}s",
                file=sys.stderr,
                flush=True,
            )
            self.wait(delay)
        self._write()
        return rc

    def _interruptible_sleep(self, seconds: float) -> None:
        end = self.clock() + seconds
        while not self.state.stopping and self.clock() < end:
            time.sleep(min(0.1, max(0.0, end - self.clock())))

    def _write(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(self.state.model_dump_json())
        os.replace(tmp, self.state_file)


def backoff_of(maximum: float | None) -> Backoff:
    """The backoff with ``maximum`` when given, else TANDEM_SUPERVISE_BACKOFF_MAX_S's."""
    if maximum is None:
        from services.common.config import CommonSettings, load_settings

        maximum = load_settings(CommonSettings, check_unknown=False).supervise_backoff_max_s
    return Backoff(maximum=maximum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--name", required=True)
    parser.add_argument("--state", required=True, type=Path, help="the JSON state file")
    parser.add_argument(
        "--backoff-max", type=float, default=None, help="seconds (default: TANDEM_SUPERVISE_BACKOFF_MAX_S)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- ARGV of the component")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to supervise (put it after --)")
    sup = Supervisor(args.name, command, args.state, backoff_of(args.backoff_max))

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        sup.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    rc = sup.run()
    return 0 if sup.state.stopping else (rc if rc >= 0 else 128 - rc)


if __name__ == "__main__":
    sys.exit(main())
