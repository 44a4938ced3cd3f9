"""The environment of a whole `tandem up` stack of its own: a fresh home and free ports, so it
runs beside any other stack (the CLI tests, and benchmarks/stack.py for the loop and chaos benchmarks)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers.servers import free_port


def isolated_stack_env(home: Path, device: str = "cpu") -> dict[str, str]:
    """This process's environment without its TANDEM_ settings, plus a home and free ports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(
        TANDEM_HOME=str(home),
        TANDEM_REDIS_PORT=str(free_port()),
        TANDEM_AGENT_PORT=str(free_port()),
        TANDEM_INFERENCE_PORT=str(free_port()),
        TANDEM_RETRIEVAL_PORT=str(free_port()),
        TANDEM_TRAINER_PORT=str(free_port()),
        TANDEM_DEVICE=device,
    )
    return env


def home_processes(home: Path) -> list[int]:
    """Pids of live processes started for ``home`` (children inherit TANDEM_HOME); not this one."""
    needle = f"TANDEM_HOME={home}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes().split(b"\0") and int(environ.parent.name) != os.getpid():
                stat = (environ.parent / "stat").read_text().rsplit(")", 1)[1].split()
                if stat[0] != "Z":
                    found.append(int(environ.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found
