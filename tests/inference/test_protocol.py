"""Engine protocol conformance of the engines that run everywhere."""

from __future__ import annotations

from pathlib import Path

from services.inference.engine.base import Engine
from services.inference.engine.remote import RemoteEngine


def test_torch_and_remote_engines_are_engines(lively_tiny_path: Path) -> None:
    from services.inference.engine.torch_engine import TorchEngine

    assert isinstance(TorchEngine.from_pretrained(lively_tiny_path, max_batch_size=1), Engine)
    assert isinstance(RemoteEngine("http://127.0.0.1:1"), Engine)
