"""Installed versions against the lock the project was tested with (requirements/base.txt).

`tandem up` and `tandem worker` check before starting anything: a package the lock names that
is not installed stops them with one line naming the package and the version the lock wants;
versions that differ (a GPU image's own torch, `make check-latest`'s newest releases) are named
in one warning line, since such an environment may still work.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass, field
from pathlib import Path

# Where a checkout or the Docker image keeps the locks (the package is installed from the repo).
LOCK = Path(__file__).resolve().parents[2] / "requirements" / "base.txt"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def canonical(name: str) -> str:
    """PEP 503 name: lower case, runs of `-`, `_` and `.` as one `-`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(lock: Path) -> dict[str, str]:
    """``{canonical name: version}`` of every pin line in a requirements lock."""
    pins: dict[str, str] = {}
    for line in lock.read_text().splitlines():
        match = _PIN.match(line)
        if match:
            pins[canonical(match.group(1))] = match.group(2)
    return pins


@dataclass
class Drift:
    lock: Path
    missing: list[tuple[str, str]] = field(default_factory=list)  # (name, locked version)
    differ: list[tuple[str, str, str]] = field(default_factory=list)  # (name, installed, locked)

    def error(self) -> str:
        """One line for the first missing package, or '' when none is missing."""
        if not self.missing:
            return ""
        name, want = self.missing[0]
        more = f" (and {len(self.missing) - 1} more)" if len(self.missing) > 1 else ""
        return (
            f"{name} is not installed; the lock wants {name}=={want}{more} ({self.lock}): "
            "run `make venv`, or pip install --require-hashes --no-deps -r requirements/base.txt"
        )

    def warning(self) -> str:
        """One line naming the installed versions that differ from the lock, or ''."""
        if not self.differ:
            return ""
        shown = ", ".join(f"{n} {have} (lock {want})" for n, have, want in self.differ[:5])
        more = f" and {len(self.differ) - 5} more" if len(self.differ) > 5 else ""
        return f"installed versions differ from {self.lock.name}: {shown}{more}"


def _same(installed: str, locked: str) -> bool:
    # The lock pins torch's CPU build (2.13.0+cpu); a wheel folder may install it without the label.
    return installed in (locked, locked.split("+")[0])


def check(lock: Path | None = None) -> Drift | None:
    """Compare the installed distributions with ``lock`` (default: LOCK); None when there is no
    lock to compare with (a package installed without the repo's requirements/)."""
    lock = lock or LOCK
    if not lock.exists():
        return None
    drift = Drift(lock)
    for name, want in read_pins(lock).items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            drift.missing.append((name, want))
            continue
        if not _same(have, want):
            drift.differ.append((name, have, want))
    return drift
