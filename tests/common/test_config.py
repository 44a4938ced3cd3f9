from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.config import (
    CommonSettings,
    ServiceSettings,
    SettingsError,
    check_unknown_env,
    env_names,
    load_settings,
)


class DemoSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_INFERENCE_", extra="ignore")
    max_batch: int = Field(8, ge=1, description="demo")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("TANDEM_"):
            monkeypatch.delenv(name)


def test_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_INFERENCE_MAX_BATCH", "lots")
    with pytest.raises(SettingsError) as err:
        load_settings(DemoSettings)
    assert "TANDEM_INFERENCE_MAX_BATCH" in str(err.value)
    assert "'lots'" in str(err.value)


def test_bad_common_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_DEVICE", "tpu")
    with pytest.raises(SettingsError, match="TANDEM_DEVICE"):
        load_settings(CommonSettings)
    monkeypatch.setenv("TANDEM_DEVICE", "cpu")
    monkeypatch.setenv("TANDEM_AGENT_PORT", "70000")
    with pytest.raises(SettingsError, match=r"TANDEM_AGENT_PORT.*65535"):
        load_settings(CommonSettings)


def test_unknown_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_INFERENCE_MAX_BATHC", "4")
    with pytest.raises(SettingsError, match="TANDEM_INFERENCE_MAX_BATHC"):
        load_settings(DemoSettings)
    monkeypatch.delenv("TANDEM_INFERENCE_MAX_BATHC")
    monkeypatch.setenv("TANDEM_HOMEDIR", "/x")
    with pytest.raises(SettingsError, match="TANDEM_HOMEDIR"):
        load_settings(DemoSettings)


def test_other_services_variables_are_left_to_them() -> None:
    env = {"TANDEM_RETRIEVAL_ANYTHING": "1", "TANDEM_HOME": "/x", "TANDEM_INFERENCE_MAX_BATCH": "2"}
    check_unknown_env(DemoSettings, environ=env)  # does not raise
    with pytest.raises(SettingsError):
        check_unknown_env(DemoSettings, environ={**env, "TANDEM_INFERENCE_NOPE": "1"})


def test_defaults_and_derived_values(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.setenv("TANDEM_RETRIEVAL_PORT", "9100")
    settings = load_settings(CommonSettings)
    assert settings.port_of("agent") == 8000
    assert settings.url_of("retrieval") == "http://127.0.0.1:9100"
    assert settings.allowed_model_roots == [tmp_path.resolve() / "models"]
    monkeypatch.setenv("TANDEM_MODEL_ROOTS", f"{tmp_path}/a:{tmp_path}/b")
    assert load_settings(CommonSettings).allowed_model_roots == [tmp_path / "a", tmp_path / "b"]
    assert "TANDEM_REDIS_URL" in env_names(CommonSettings)


def test_a_given_redis_url_is_told_from_the_default_even_with_a_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`tandem up` starts its embedded Valkey only when no TANDEM_REDIS_URL is set: the password
    setting, which rewrites the URL, must not make the default look given."""
    monkeypatch.setenv("TANDEM_REDIS_PASSWORD", "s3cret")
    default = load_settings(CommonSettings)
    assert default.redis_url == "redis://:s3cret@127.0.0.1:6379/0" and not default.redis_url_given
    monkeypatch.setenv("TANDEM_REDIS_URL", "redis://cache:6379/0")
    given = load_settings(CommonSettings)
    assert given.redis_url == "redis://:s3cret@cache:6379/0" and given.redis_url_given


def test_redis_url_scheme_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_REDIS_URL", "localhost:6379")
    with pytest.raises(SettingsError, match="TANDEM_REDIS_URL"):
        load_settings(CommonSettings)
