"""The processes of one embedded stack: find them, tell what is wrong with them, stop them.

``observe`` reads ``$TANDEM_HOME/run`` (each supervisor's pid file and state file) and /proc:
for each component, its supervisor (when alive and really the stack's), its process (when
alive and really the one the supervisor recorded), and a line for each file that is stale,
names a pid another program now holds, or does not parse. Supervisors of the home that no pid
file names are found by their command line and environment too.

``stop`` stops components by process group: SIGTERM to each supervisor (it passes it to its
component's group) and to each component whose supervisor is gone, then SIGKILL to whatever is
left after the grace period, services and workers first and Redis last (workers acknowledge to
it on the way down). Only processes checked as the stack's (services/cli/procs.py) are
signalled. The last error of each component outlives ``tandem down`` in ``run/errors.json``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from services.cli import procs
from services.cli.stack import Layout, read_pid, write_secret
from services.cli.supervise import StateUnreadable, SupervisedState, load_state

Say = Callable[[str], object]


@dataclass
class Observed:
    name: str
    supervisor: procs.ProcInfo | None = None  # alive and the stack's
    child: procs.ProcInfo | None = None  # the component's process: alive and the recorded one
    # processes left in the component's group (its own children) after the component died
    strays: list[procs.ProcInfo] = field(default_factory=list)
    state: SupervisedState | None = None
    notes: list[str] = field(default_factory=list)  # what is wrong with its files

    @property
    def running(self) -> bool:
        return self.supervisor is not None

    @property
    def orphaned(self) -> bool:
        """The component's process (or its children) runs, its supervisor is gone."""
        return self.supervisor is None and (self.child is not None or bool(self.strays))


def _names(layout: Layout) -> set[str]:
    if not layout.run_dir.exists():
        return set()
    return {p.stem for p in layout.run_dir.glob("*.pid")} | {
        p.name.removesuffix(".state.json") for p in layout.run_dir.glob("*.state.json")
    }


def _describe(proc: procs.ProcInfo) -> str:
    cmd = " ".join(proc.cmdline)[:80] or proc.exe or "?"
    return f"{cmd!r}"


def observe(layout: Layout) -> dict[str, Observed]:
    home = layout.home
    unlisted = {procs.supervisor_name(p): p for p in procs.supervisors_of(home)}
    out: dict[str, Observed] = {}
    for name in sorted(_names(layout) | {n for n in unlisted if n}):
        ob = Observed(name)
        pid_file = layout.pid_file(name)
        if pid_file.exists():
            pid = read_pid(pid_file)
            proc = procs.info(pid) if pid else None
            if pid is None:
                ob.notes.append(f"{pid_file} does not hold a pid: ignored")
            elif procs.is_supervisor(proc, home, name):
                ob.supervisor = proc
            elif procs.alive(proc) and proc is not None:
                ob.notes.append(
                    f"{pid_file} names pid {pid}, now another program ({_describe(proc)}), not the "
                    f"supervisor of {name}: left alone"
                )
        if ob.supervisor is None and name in unlisted:
            ob.supervisor = unlisted[name]
            ob.notes.append(
                f"the supervisor of {name} runs as pid {ob.supervisor.pid}, not as {pid_file} says"
            )
        try:
            ob.state = load_state(layout.supervised_state(name))
        except StateUnreadable as exc:
            ob.notes.append(f"{exc}: its component's process cannot be found from it")
        if ob.state is not None and ob.state.pid:
            child = procs.info(ob.state.pid)
            if procs.is_component(child, home, ob.state.pid_start, ob.state.exe):
                ob.child = child
            elif not procs.alive(child):  # a pid is not reused while its group lives
                ob.strays = [m for m in procs.group_members(ob.state.pid) if procs.same_home(m, home)]
            elif ob.supervisor is None and child is not None:
                ob.notes.append(
                    f"{layout.supervised_state(name)} names pid {ob.state.pid} for {name}, now another "
                    f"program ({_describe(child)}): left alone"
                )
        stale = (
            pid_file.exists() and (pid := read_pid(pid_file)) is not None and not procs.alive(procs.info(pid))
        )
        if ob.supervisor is None and stale:
            what = (
                "its process still runs"
                if ob.child
                else f"{len(ob.strays)} process(es) of its group still run"
                if ob.strays
                else "nothing of it runs"
            )
            ob.notes.append(
                f"the supervisor of {name} (pid {read_pid(pid_file)}) is gone ({pid_file} is stale); {what}"
            )
        out[name] = ob
    return out


@dataclass
class StopReport:
    stopped: list[str] = field(default_factory=list)  # components with something stopped
    hard: list[str] = field(default_factory=list)  # "NAME's supervisor (pid N)" killed with SIGKILL
    left: list[str] = field(default_factory=list)  # still alive after SIGKILL


def _leaders(ob: Observed) -> list[tuple[str, procs.ProcInfo]]:
    out = []
    if ob.supervisor is not None:
        out.append((f"{ob.name}'s supervisor", ob.supervisor))
    if ob.child is not None:
        out.append((f"{ob.name}'s process", ob.child))
    out += [(f"{ob.name}'s child process", p) for p in ob.strays]
    return out


def _wait_gone(leaders: Iterable[procs.ProcInfo], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(procs.group_alive(p) for p in leaders) and time.monotonic() < deadline:
        time.sleep(0.1)


def stop(
    layout: Layout,
    say: Say = print,
    only: set[str] | None = None,
    grace: float = 15.0,
    observed: dict[str, Observed] | None = None,
) -> StopReport:
    """Stop the components (``only`` those named), SIGTERM then SIGKILL after ``grace``
    seconds; their pid and state files go, their last error is kept."""
    import signal

    obs = observed if observed is not None else observe(layout)
    if observed is None:
        for ob in obs.values():
            for note in ob.notes:
                say(note)
    report = StopReport()
    chosen = [ob for ob in obs.values() if only is None or ob.name in only]
    left_names: set[str] = set()
    for batch in ([o for o in chosen if o.name != "redis"], [o for o in chosen if o.name == "redis"]):
        leaders = [(label, p) for ob in batch for label, p in _leaders(ob)]
        for ob in batch:
            if ob.supervisor is not None:
                child = f", component pid {ob.child.pid}" if ob.child else ""
                say(f"stopping {ob.name} (supervisor pid {ob.supervisor.pid}{child})")
                procs.signal_group(ob.supervisor, layout.home, signal.SIGTERM)
            elif ob.orphaned:
                pids = ", ".join(str(p.pid) for _, p in _leaders(ob))
                say(f"stopping {ob.name} (pid {pids}; its supervisor is gone)")
                for _, p in _leaders(ob):
                    procs.signal_group(p, layout.home, signal.SIGTERM)
            if ob.running or ob.orphaned:
                report.stopped.append(ob.name)
        _wait_gone([p for _, p in leaders], grace)
        hard = [(label, p) for label, p in leaders if procs.group_alive(p)]
        for label, p in hard:
            procs.signal_group(p, layout.home, signal.SIGKILL)
            report.hard.append(f"{label} (pid {p.pid})")
            say(f"killed {label} (pid {p.pid}) with SIGKILL: still running {grace:.0f}s after SIGTERM")
        _wait_gone([p for _, p in hard], 5.0)
        still = [(label, p) for label, p in hard if procs.group_alive(p)]
        report.left += [f"{label} (pid {p.pid})" for label, p in still]
        left_names |= {label.split("'", 1)[0] for label, _ in still}
    for ob in chosen:
        if ob.name in left_names:
            continue
        if ob.state is not None and ob.state.last_error:
            record_error(layout, ob.name, ob.state.last_error, ob.state.last_exit_at or time.time())
        layout.pid_file(ob.name).unlink(missing_ok=True)
        layout.supervised_state(ob.name).unlink(missing_ok=True)
    return report


# -- the last error of each component -------------------------------------------------------
def load_errors(layout: Layout) -> dict[str, dict[str, object]]:
    try:
        data = json.loads(layout.errors_file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_error(layout: Layout, name: str, error: str, at: float) -> None:
    errors = load_errors(layout)
    errors[name] = {"error": error, "at": at}
    layout.run_dir.mkdir(parents=True, exist_ok=True)
    write_secret(layout.errors_file, json.dumps(errors))


def clear_error(layout: Layout, name: str) -> None:
    errors = load_errors(layout)
    if errors.pop(name, None) is not None:
        write_secret(layout.errors_file, json.dumps(errors))
