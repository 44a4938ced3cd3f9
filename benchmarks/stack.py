"""The embedded stack (`tandem up` in a temporary home, on free ports) for benchmarks that need
the whole product running: its environment, start and stop."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.stack import isolated_stack_env

REPO = Path(__file__).resolve().parent.parent
TANDEM = [sys.executable, "-m", "services.cli.main"]
SERVICES = ("agent", "inference", "retrieval", "trainer")


@dataclass
class Stack:
    home: Path
    env: dict[str, str]

    @property
    def key(self) -> str:
        return (self.home / "api-key").read_text().strip()

    def url(self, service: str) -> str:
        return f"http://127.0.0.1:{self.env[f'TANDEM_{service.upper()}_PORT']}"


@contextmanager
def embedded_stack(
    prefix: str, extra_env: dict[str, str] | None = None, keep: bool = False, timeout: float = 900
) -> Iterator[Stack]:
    home = Path(tempfile.mkdtemp(prefix=prefix)) / "home"
    env = {**isolated_stack_env(home), **(extra_env or {})}
    print(f"starting the stack in {home} ...", flush=True)
    up = subprocess.run(
        [*TANDEM, "up", "--timeout", str(timeout)], env=env, cwd=REPO, capture_output=True, text=True
    )
    if up.returncode != 0:
        raise RuntimeError(f"tandem up failed:\n{up.stdout}{up.stderr}")
    try:
        yield Stack(home, env)
    finally:
        if keep:
            print(f"stack left running: TANDEM_HOME={home}")
        else:
            subprocess.run([*TANDEM, "down"], env=env, cwd=REPO, capture_output=True, text=True)
