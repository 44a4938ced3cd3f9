"""Run every benchmark (or those named): ``python -m benchmarks.run [kernels retrieval ...]``.

Each area is a package ``benchmarks/<area>`` whose ``__main__`` prints its own table
with ratios against a baseline measured in the same run.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

AREAS = ("kernels", "retrieval", "inference", "training", "agent")


def main(argv: list[str]) -> int:
    chosen = [a for a in argv if not a.startswith("-")] or list(AREAS)
    failed = []
    for area in chosen:
        if importlib.util.find_spec(f"benchmarks.{area}.__main__") is None:
            print(f"== {area}: no benchmark yet")
            continue
        print(f"== {area}")
        if subprocess.call([sys.executable, "-m", f"benchmarks.{area}"]) != 0:
            failed.append(area)
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
