"""What /proc says of a process: whether it belongs to one embedded stack, and its group.

``tandem up``, ``status`` and ``down`` only ever signal processes of their own stack. A pid in
a file may be stale (the process is gone) or reused by another program, so before a signal
each pid is checked here: a supervisor by its command line (``-m services.cli.supervise
--name NAME``) and the home in its environment (``TANDEM_HOME``); a component by the start
time and executable its supervisor recorded (Valkey rewrites its own environment and command
line for its process title, so those cannot be read back) and, where readable, the home.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    state: str  # "R", "S", "Z", ...
    pgid: int
    start: int  # clock ticks after boot: with the pid, names one process for ever
    cmdline: list[str]
    environ: dict[str, str]
    exe: str


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgid, start time) of ``pid``."""
    stat = _read(PROC / str(pid) / "stat")
    if stat is None:
        return None
    try:
        fields = stat.decode(errors="replace").rsplit(")", 1)[1].split()
        return fields[0], int(fields[2]), int(fields[19])
    except (IndexError, ValueError):
        return None


def info(pid: int) -> ProcInfo | None:
    """The process ``pid`` as /proc shows it; None when there is none (or no /proc)."""
    stat = _stat(pid)
    if stat is None:
        return None
    state, pgid, start = stat
    cmdline = [a.decode(errors="replace") for a in (_read(PROC / str(pid) / "cmdline") or b"").split(b"\0")]
    environ: dict[str, str] = {}
    for item in (_read(PROC / str(pid) / "environ") or b"").split(b"\0"):
        key, sep, value = item.decode(errors="replace").partition("=")
        if sep:
            environ[key] = value
    try:
        exe = os.readlink(PROC / str(pid) / "exe")
    except OSError:
        exe = ""
    return ProcInfo(pid, state, pgid, start, [a for a in cmdline if a], environ, exe)


def alive(proc: ProcInfo | None) -> bool:
    return proc is not None and proc.state not in ("Z", "X")


def start_time(pid: int) -> int | None:
    stat = _stat(pid)
    return stat[2] if stat else None


def executable(pid: int) -> str:
    proc = info(pid)
    return proc.exe if proc else ""


def same_home(proc: ProcInfo, home: Path) -> bool:
    given = proc.environ.get("TANDEM_HOME")
    return given is not None and os.path.realpath(given) == os.path.realpath(home)


def is_supervisor(proc: ProcInfo | None, home: Path, name: str | None = None) -> bool:
    """A live ``services.cli.supervise`` of ``home`` (of component ``name`` when given)."""
    if not alive(proc) or proc is None or not same_home(proc, home):
        return False
    args = proc.cmdline
    if "services.cli.supervise" not in args:
        return False
    if name is None:
        return True
    return any(args[i] == "--name" and args[i + 1] == name for i in range(len(args) - 1))


def supervisor_name(proc: ProcInfo) -> str | None:
    args = proc.cmdline
    return next((args[i + 1] for i in range(len(args) - 1) if args[i] == "--name"), None)


def is_component(proc: ProcInfo | None, home: Path, start: int | None, exe: str | None) -> bool:
    """A live component process: the one its supervisor recorded (same start time and, when
    recorded, executable), of ``home`` when its environment can still be read."""
    if not alive(proc) or proc is None or start is None or proc.start != start:
        return False
    if exe and proc.exe and proc.exe != exe:
        return False
    return "TANDEM_HOME" not in proc.environ or same_home(proc, home)


def all_pids() -> list[int]:
    try:
        return [int(p.name) for p in PROC.iterdir() if p.name.isdigit()]
    except OSError:
        return []


def group_members(pgid: int) -> list[ProcInfo]:
    """Live processes of process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []
    except PermissionError:
        pass
    out = []
    for pid in all_pids():
        stat = _stat(pid)
        if stat is not None and stat[1] == pgid and stat[0] not in ("Z", "X"):
            proc = info(pid)
            if alive(proc) and proc is not None:
                out.append(proc)
    return out


def supervisors_of(home: Path) -> list[ProcInfo]:
    """Every live supervisor of ``home``, whether or not a pid file names it."""
    found = []
    for pid in all_pids():
        if b"services.cli.supervise" not in (_read(PROC / str(pid) / "cmdline") or b""):
            continue
        proc = info(pid)
        if proc is not None and is_supervisor(proc, home):
            found.append(proc)
    return found


def signal_group(leader: ProcInfo, home: Path, sig: int) -> None:
    """``sig`` to the process group that ``leader`` (checked as the stack's by the caller)
    leads; when a member of the group is not of ``home`` (it moved its environment or was
    put there by someone else), only the leader and the members of ``home`` are signalled."""
    members = group_members(leader.pgid)
    if leader.pgid == leader.pid and all(m.pid == leader.pid or same_home(m, home) for m in members):
        try:
            os.killpg(leader.pgid, sig)
            return
        except (ProcessLookupError, PermissionError):
            pass
    for m in members:
        if m.pid == leader.pid or same_home(m, home):
            try:
                os.kill(m.pid, sig)
            except (ProcessLookupError, PermissionError):
                continue
    if not members:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(leader.pid, sig)


def group_alive(leader: ProcInfo) -> bool:
    """Whether the leader or any member of its group still runs (zombies do not count)."""
    stat = _stat(leader.pid)
    if stat is not None and stat[0] not in ("Z", "X") and stat[2] == leader.start:
        return True
    return bool(group_members(leader.pgid)) if leader.pgid == leader.pid else False


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


LIBC = _libc()


def die_with_parent(sig: int, parent: int) -> None:
    """In a child between fork and exec: receive ``sig`` when the parent dies (Linux
    ``PR_SET_PDEATHSIG``), and exit at once if the parent died before this was set."""
    if not sig:
        return
    if LIBC is not None:
        LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(signal.SIGKILL + 128)
