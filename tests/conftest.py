"""Shared fixtures: a real Valkey server for the session, API keys, settings in a temp home."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.common.auth import KeyStore
from tests.helpers.servers import valkey_server

REPO_ROOT = Path(__file__).resolve().parent.parent
# Converted models (e.g. SmolLM2 from GGUF to safetensors) are cached across test runs here.
TEST_CACHE = REPO_ROOT / ".cache" / "tests"


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with valkey_server(tmp_path_factory.mktemp("valkey")) as url:
        yield url


@pytest.fixture()
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture()
def key_store(redis_client: redis.Redis) -> KeyStore:
    return KeyStore(redis_client)


@pytest.fixture()
def api_key(key_store: KeyStore) -> str:
    """A fresh admin key for tenant ``acme`` (the role a tenant's own key has; tests of member
    keys create those themselves)."""
    return key_store.create("acme", role="admin")[0]


@pytest.fixture()
def other_key(key_store: KeyStore) -> str:
    """A key of another tenant, for isolation tests."""
    return key_store.create("globex")[0]


@pytest.fixture()
def tandem_env(tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """TANDEM_ settings pointing at a temp home and the session's Valkey; returns the home."""
    for name in list(os.environ):
        if name.startswith("TANDEM_"):
            monkeypatch.delenv(name)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("TANDEM_HOME", str(home))
    monkeypatch.setenv("TANDEM_REDIS_URL", redis_url)
    monkeypatch.setenv("TANDEM_LOG_JSON", "false")
    return home


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct (safetensors, cached under .cache/models)."""
    from tests.helpers.models import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template."""
    from tests.helpers.models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
