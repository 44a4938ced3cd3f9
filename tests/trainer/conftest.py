"""Fixtures of the trainer tests: small datasets in the shapes of GSM8K and HH-RLHF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# Small synthetic rows in the public datasets' shapes (written for the tests, see
# tests/data/README.md): GSM8K's question/answer with ``#### <number>``, HH-RLHF's chosen and
# rejected dialogues sharing a prompt.
DATA = Path(__file__).resolve().parents[1] / "data"
GSM8K = DATA / "gsm8k-style.jsonl"
HH = DATA / "hh-style.jsonl"


def head_lines(path: Path, n: int) -> bytes:
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


def count_to_rows(last: int) -> list[dict]:
    """SFT rows "Count to n." -> "1 2 ... n" for n = 1 .. last: short, varied, learnable."""
    return [
        {
            "messages": [
                {"role": "user", "content": f"Count to {n}."},
                {"role": "assistant", "content": " ".join(str(i) for i in range(1, n + 1))},
            ]
        }
        for n in range(1, last + 1)
    ]
