"""Fixtures of the inference tests: a tiny model whose greedy output is not degenerate."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def lively_tiny_path(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Path:
    """The tiny 2-layer Llama with larger random weights, so greedy decoding wanders through
    the vocabulary instead of repeating one token (a real test of token-for-token equality)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tmp_path_factory.mktemp("lively-tiny")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "embed" in name else 0.15))
    model.save_pretrained(target, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(target)
    return target


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The tiny models gain nothing from a second CPU thread, and on a machine shared with
    other jobs two OpenMP threads wait on each other (measured 5x slower): use one here."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def key(redis_url: str) -> str:
    """A key of the tenant ``acme``, made once per module (a module may ask for its own)."""
    import redis

    from services.common.auth import KeyStore

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return str(KeyStore(client).create("acme")[0])
    finally:
        client.close()
