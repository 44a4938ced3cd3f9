"""Builds the agent service's FastAPI app (``uvicorn services.agent.app:create_app --factory``)."""

from __future__ import annotations

from fastapi import FastAPI

from services.agent.config import AgentSettings
from services.common.app_factory import create_service_app
from services.common.config import CommonSettings, load_settings


def create_app(common: CommonSettings | None = None, settings: AgentSettings | None = None) -> FastAPI:
    common = common or load_settings(CommonSettings, check_unknown=False)
    settings = settings or load_settings(AgentSettings)
    app = create_service_app("agent", common)
    app.state.settings = settings
    return app
