"""Settings of the inference service (env prefix ``TANDEM_INFERENCE_``)."""

from __future__ import annotations

from pydantic_settings import SettingsConfigDict

from services.common.config import ServiceSettings


class InferenceSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_INFERENCE_", extra="ignore")
