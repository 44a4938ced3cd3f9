"""Fixtures of the trainer tests: small real datasets and the tiny model loaded in fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# The repo's sibling shared/ folder; a git worktree one level deeper finds it one level up.
SHARED_DATA = next(
    (
        p / "shared" / "data"
        for p in Path(__file__).resolve().parents[3:5]
        if (p / "shared" / "data").is_dir()
    ),
    Path(__file__).resolve().parents[3] / "shared" / "data",
)
GSM8K = SHARED_DATA / "gsm8k" / "train.jsonl"
HH = SHARED_DATA / "hh-rlhf" / "harmless-base.jsonl"


def head_lines(path: Path, n: int) -> bytes:
    if not path.is_file():
        pytest.skip(f"shared data file {path} is missing")
    with path.open("rb") as f:
        return b"".join(next(f) for _ in range(n))


@pytest.fixture(scope="session")
def gsm8k_rows() -> bytes:
    return head_lines(GSM8K, 24)


@pytest.fixture(scope="session")
def hh_rows() -> bytes:
    return head_lines(HH, 12)


def jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)
