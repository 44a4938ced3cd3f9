"""The CPU stack the agent benchmarks start: an embedded Valkey, then the retrieval, inference and
agent services as separate uvicorn processes (as ``tandem up`` runs them), with a key to call them.

Shared by ``benchmarks.agent``, ``benchmarks.answers`` and (its pieces) ``benchmarks.inference``
and ``benchmarks.loop``, so each starts services the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.helpers.servers import free_port

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("retrieval", "inference", "agent")

__all__ = ["REPO", "CpuStack", "cpu_stack", "free_port", "service_env", "start_service", "uvicorn_command"]


def bench_base(stack: ExitStack, home: Path, model_dir: Path) -> tuple[str, str, Any]:
    """A Valkey under ``home`` (closed with ``stack``), a tenant key of it, and the common settings
    of in-process services that find ``model_dir``'s model: (redis URL, key, settings)."""
    from services.common.auth import KeyStore
    from services.common.config import CommonSettings
    from services.common.redis_conn import sync_redis
    from tests.helpers.servers import valkey_server

    redis_url = stack.enter_context(valkey_server(home / "valkey"))
    key = KeyStore(sync_redis(redis_url)).create("bench")[0]
    base = CommonSettings(
        home=home, redis_url=redis_url, log_json=False, model_roots=f"{home}:{model_dir.parent}"
    )
    return redis_url, key, base


def uvicorn_command(service: str, port: int) -> list[str]:
    """The command line serving ``services.<service>.app`` on ``port`` (warnings only)."""
    return [
        sys.executable,
        "-m",
        "uvicorn",
        f"services.{service}.app:create_app",
        "--factory",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]


def service_env(home: Path, redis_url: str, **settings: str) -> dict[str, str]:
    """This process's environment without its ``TANDEM_*`` settings (a developer's own must not
    leak into a measurement), pointed at ``home`` and ``redis_url``, offline, plus ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(TANDEM_HOME=str(home), TANDEM_REDIS_URL=redis_url, TANDEM_LOG_JSON="false", HF_HUB_OFFLINE="1")
    env.update(settings)
    return env


def start_service(name: str, port: int, env: dict[str, str], log_dir: Path) -> subprocess.Popen[bytes]:
    log = (log_dir / f"{name}.log").open("wb")
    return subprocess.Popen(
        uvicorn_command(name, port), env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
    )


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout} s")


@dataclass
class CpuStack:
    home: Path
    key: str
    urls: dict[str, str]  # service name -> base URL


@contextmanager
def cpu_stack(home: Path, **settings: str) -> Iterator[CpuStack]:
    """Valkey and the three services with the default model (SmolLM2-135M-Instruct) in ``home``;
    ``settings`` are extra ``TANDEM_*`` variables. Logs go to ``home/<service>.log``."""
    from services.common.auth import KeyStore
    from services.common.redis_conn import sync_redis
    from tests.helpers.models import smollm2_dir
    from tests.helpers.servers import valkey_server

    model_dir = smollm2_dir()
    with ExitStack() as stack:
        redis_url = stack.enter_context(valkey_server(home / "valkey"))
        key = KeyStore(sync_redis(redis_url)).create("bench")[0]
        ports = {s: free_port() for s in SERVICES}
        env = service_env(
            home,
            redis_url,
            TANDEM_MODEL_ROOTS=f"{home}:{model_dir.parent}",
            TANDEM_INFERENCE_MODEL=str(model_dir),
            TANDEM_AGENT_TOKENIZER=str(model_dir),
            **{f"TANDEM_{s.upper()}_PORT": str(p) for s, p in ports.items()},
            **settings,
        )
        procs = {}
        for name in SERVICES:
            procs[name] = start_service(name, ports[name], env, home)
            stack.callback(procs[name].terminate)
        urls = {s: f"http://127.0.0.1:{p}" for s, p in ports.items()}
        for name, proc in procs.items():
            wait_ready(urls[name], proc)
        yield CpuStack(home, key, urls)
