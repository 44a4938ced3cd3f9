"""Builds the retrieval service's FastAPI app (``uvicorn services.retrieval.app:create_app --factory``)."""

from __future__ import annotations

from fastapi import FastAPI

from services.common.app_factory import create_service_app
from services.common.config import CommonSettings, load_settings
from services.retrieval.config import RetrievalSettings


def create_app(common: CommonSettings | None = None, settings: RetrievalSettings | None = None) -> FastAPI:
    common = common or load_settings(CommonSettings, check_unknown=False)
    settings = settings or load_settings(RetrievalSettings)
    app = create_service_app("retrieval", common)
    app.state.settings = settings
    return app
