"""Settings of the retrieval service (env prefix ``TANDEM_RETRIEVAL_``)."""

from __future__ import annotations

from pydantic_settings import SettingsConfigDict

from services.common.config import ServiceSettings


class RetrievalSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_RETRIEVAL_", extra="ignore")
