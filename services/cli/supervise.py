"""Keeps one component of the embedded stack running, as compose's ``restart`` policy does.

``tandem up`` starts every component under this supervisor::

    python -m services.cli.supervise --name retrieval --state RUN/retrieval.state.json -- ARGV...

The supervisor runs ARGV as its child in a process group of the child's own, which the
supervisor signals to stop it (the component and the component's children together). On Linux
the child gets ``PR_SET_PDEATHSIG`` before exec (``--death-signal``, SIGKILL by default): a
supervisor killed with SIGKILL takes its component with it, so nothing is left holding the
component's port. Elsewhere the state file records the child (pid and start time), and
``tandem down`` / ``tandem up`` find it there. When the component exits for
any reason other than being told to stop, it is started again after a backoff that doubles from
``initial`` up to ``maximum`` seconds, and goes back to ``initial`` once a run lasted
``reset_after`` seconds (a component that crashes at once is not restarted in a tight loop).

Each start and exit is written to the state file (JSON, replaced atomically): the component's
pid and start time, its restarts, its last exit status and when, and the line of its log
(``--log``) that says why it ended (the exception's message). ``tandem status`` shows them, and
``tandem up`` reads them to tell a component that dies during start-up from one still starting
and to print why.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
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

from services.cli import procs


class SupervisedState(BaseModel):
    """What ``tandem status`` shows of a supervised component."""

    name: str
    supervisor_pid: int
    pid: int | None = None  # the component's own process, None between runs
    pid_start: int | None = None  # its start time (/proc/PID/stat): tells a reused pid apart
    exe: str | None = None  # its executable (/proc/PID/exe)
    started_at: float | None = None  # wall clock of the current run's start
    restarts: int = 0
    last_exit: int | None = None  # exit status; negative: killed by that signal
    last_exit_at: float | None = None
    stopping: bool = False
    last_error: str | None = None  # why the last run ended, from its log

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


class StateUnreadable(ValueError):
    pass


def load_state(path: Path) -> SupervisedState | None:
    """The state in ``path``; None when there is no file; StateUnreadable (naming the file) when
    it does not parse."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateUnreadable(f"{path} cannot be read ({exc.strerror})") from None
    try:
        return SupervisedState.model_validate_json(text)
    except ValueError:
        raise StateUnreadable(f"{path} does not parse as a supervisor's state") from None


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|NotFound|Interrupt|Failure)\b.*")
_LOG_ERROR = re.compile(r"(\bERROR\b|\bFatal\b|\bCRITICAL\b|[Ee]rror:)")


def error_line(log_text: str, limit: int = 400) -> str | None:
    """The line of a component's log that says why it ended: the last traceback's exception
    (``Type: message``, with the message's continuation lines), else the last error line, else
    the last line. Lines the supervisor wrote are skipped."""
    raw = [ln.rstrip() for ln in log_text.splitlines() if not ln.startswith("[supervise]")]
    lines = [ln for ln in raw if ln]
    if not lines:
        return None
    last_tb = max((i for i, ln in enumerate(raw) if "Traceback (most recent call last)" in ln), default=-1)
    for i in range(last_tb + 1 if last_tb >= 0 else len(raw), len(raw)):
        if raw[i] and not raw[i].startswith((" ", "\t")):
            parts = [raw[i]]
            for more in raw[i + 1 :]:  # a message of several lines, up to a blank or a log line
                if not more or more.startswith((" ", "\t", "[")) or _LOG_ERROR.search(more):
                    break
                parts.append(more)
            return _clip(" ".join(parts), limit)
    for ln in reversed(lines):
        if _EXCEPTION_LINE.match(ln) or _LOG_ERROR.search(ln):
            return _clip(ln, limit)
    return _clip(lines[-1], limit)


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _log_size(log: Path | None) -> int:
    try:
        return log.stat().st_size if log else 0
    except OSError:
        return 0


def _log_since(log: Path | None, offset: int, most: int = 65536) -> str:
    if log is None:
        return ""
    try:
        with log.open("rb") as f:
            f.seek(max(offset, _log_size(log) - most))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


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


def spawn_owned(argv: Sequence[str], death_signal: int = signal.SIGKILL) -> Child:
    """``argv`` as a child in a process group of its own, that gets ``death_signal`` when
    this process dies (Linux), however it dies."""
    parent = os.getpid()
    return subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        close_fds=True,
        process_group=0,
        preexec_fn=functools.partial(procs.die_with_parent, death_signal, parent),
    )


class Supervisor:
    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        state_file: Path,
        backoff: Backoff = Backoff(),
        spawn: Spawn | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        wait: Callable[[float], None] | None = None,
        log: Path | None = None,
        death_signal: int = signal.SIGKILL,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.state_file = state_file
        self.backoff = backoff
        self.spawn = spawn or functools.partial(spawn_owned, death_signal=death_signal)
        self.log = log
        self.clock = clock
        self.wall = wall
        self.wait = wait or self._interruptible_sleep
        self.state = SupervisedState(name=name, supervisor_pid=os.getpid())
        self.child: Child | None = None

    def stop(self) -> None:
        """Stop supervising: the running component is asked to stop and is not started again."""
        self.state.stopping = True
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(self.child.pid) == self.child.pid:
                    os.killpg(self.child.pid, signal.SIGTERM)  # its own children too
                    return
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
            log_at = _log_size(self.log)
            self.child = self.spawn(self.argv)
            runs += 1
            self.state.pid, self.state.started_at = self.child.pid, self.wall()
            self.state.pid_start = procs.start_time(self.child.pid)
            self.state.exe = procs.executable(self.child.pid) or None
            self._write()
            rc = self.child.wait()
            self.child = None
            self.state.pid, self.state.last_exit, self.state.last_exit_at = None, rc, self.wall()
            self.state.pid_start = self.state.exe = None
            if self.state.stopping:
                break
            if rc != 0:  # killed: the signal says it; an exit: the log says why
                logged = error_line(_log_since(self.log, log_at)) if rc > 0 else None
                self.state.last_error = logged or self.state.last_exit_text()
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
    parser.add_argument("--log", type=Path, default=None, help="the component's log (its output)")
    parser.add_argument(
        "--death-signal",
        default="KILL",
        help="signal the component gets when this supervisor dies (Linux; default KILL; NONE: "
        "none, as where the platform has no such signal)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- ARGV of the component")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to supervise (put it after --)")
    try:
        given = args.death_signal.upper().removeprefix("SIG")
        death = 0 if given in ("0", "NONE") else signal.Signals[f"SIG{given}"]
    except KeyError:
        parser.error(f"--death-signal {args.death_signal!r} is not a signal name (TERM, KILL, ...)")
    sup = Supervisor(
        args.name, command, args.state, backoff_of(args.backoff_max), log=args.log, death_signal=death
    )

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        sup.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    rc = sup.run()
    return 0 if sup.state.stopping else (rc if rc >= 0 else 128 - rc)


if __name__ == "__main__":
    sys.exit(main())
