"""The locks: up to date with pyproject.toml, and installed versions checked against them."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli import main as cli
from services.common import lockcheck

REPO_ROOT = Path(__file__).resolve().parents[2]
LOCK_TOOL = REPO_ROOT / "requirements" / "lock.py"


def _lock_tool(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(cwd / "requirements" / "lock.py"), *args], capture_output=True, text=True
    )


def test_committed_locks_match_pyproject() -> None:
    done = _lock_tool("check")
    assert done.returncode == 0, done.stderr


def test_changed_pyproject_without_new_lock_is_refused(tmp_path: Path) -> None:
    (tmp_path / "requirements").mkdir()
    for name in ("lock.py", "base.txt", "dev.txt", "bench.txt", "gpu-constraints.txt"):
        (tmp_path / "requirements" / name).write_text((REPO_ROOT / "requirements" / name).read_text())
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(pyproject)
    assert _lock_tool("check", cwd=tmp_path).returncode == 0
    (tmp_path / "pyproject.toml").write_text(pyproject.replace('"httpx>=0.27"', '"httpx>=0.28"'))
    done = _lock_tool("check", cwd=tmp_path)
    assert done.returncode == 1
    assert "run `make lock`" in done.stderr
    # an edit outside the dependency tables needs no new lock
    (tmp_path / "pyproject.toml").write_text(pyproject.replace("line-length = 110", "line-length = 100"))
    assert _lock_tool("check", cwd=tmp_path).returncode == 0


def test_every_locked_package_is_installed_at_its_version() -> None:
    drift = lockcheck.check()
    assert drift is not None
    assert drift.missing == []
    assert drift.differ == [], drift.warning()


def test_pick_gives_one_entry_with_its_hashes() -> None:
    done = _lock_tool("pick", "torch")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("torch==2.13.0")
    assert all(line.strip().startswith("--hash=sha256:") for line in lines[1:]) and len(lines) > 1


def _fake_lock(tmp_path: Path, pins: dict[str, str]) -> Path:
    lock = tmp_path / "base.txt"
    lock.write_text(
        "# header\n"
        + "".join(f"{n}=={v} \\\n    --hash=sha256:{'0' * 64}\n    # via tandem\n" for n, v in pins.items())
    )
    return lock


def test_missing_package_is_one_line_naming_it_and_its_version(tmp_path: Path) -> None:
    httpx_version = importlib.metadata.version("httpx")
    lock = _fake_lock(tmp_path, {"httpx": httpx_version, "no-such-dist-tandem": "1.2.3"})
    drift = lockcheck.check(lock)
    assert drift is not None
    assert drift.missing == [("no-such-dist-tandem", "1.2.3")]
    assert "no-such-dist-tandem==1.2.3" in drift.error() and "\n" not in drift.error()


def test_other_versions_are_a_warning_naming_them(tmp_path: Path) -> None:
    lock = _fake_lock(
        tmp_path, {"HTTPX": "0.0.1", "Typing_Extensions": importlib.metadata.version("typing-extensions")}
    )
    drift = lockcheck.check(lock)
    assert drift is not None
    assert drift.error() == ""
    assert drift.differ == [("httpx", importlib.metadata.version("httpx"), "0.0.1")]
    assert "httpx" in drift.warning() and "(lock 0.0.1)" in drift.warning()


def test_cpu_label_of_the_lock_matches_an_unlabelled_install(tmp_path: Path) -> None:
    lock = _fake_lock(tmp_path, {"httpx": importlib.metadata.version("httpx") + "+cpu"})
    drift = lockcheck.check(lock)
    assert drift is not None and drift.differ == []


def test_tandem_up_stops_on_a_missing_package(
    tmp_path: Path, tandem_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lockcheck, "LOCK", _fake_lock(tmp_path, {"no-such-dist-tandem": "9.9"}))
    # a setting that stops start-up later too, so a missing check fails here without starting a stack
    monkeypatch.setenv("TANDEM_DEVICE", "tpu")
    result = CliRunner().invoke(cli.app, ["up"])
    assert result.exit_code == 1
    assert "no-such-dist-tandem is not installed; the lock wants no-such-dist-tandem==9.9" in " ".join(
        result.output.split()
    )
    assert "Starting Tandem" not in result.output
