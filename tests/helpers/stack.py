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
