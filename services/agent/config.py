"""Settings of the agent service (env prefix ``TANDEM_AGENT_``)."""

from __future__ import annotations

from pydantic_settings import SettingsConfigDict

from services.common.config import ServiceSettings


class AgentSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_AGENT_", extra="ignore")
