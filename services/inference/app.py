"""Builds the inference service's FastAPI app (``uvicorn services.inference.app:create_app --factory``)."""

from __future__ import annotations

from fastapi import FastAPI

from services.common.app_factory import create_service_app
from services.common.config import CommonSettings, load_settings
from services.inference.config import InferenceSettings


def create_app(common: CommonSettings | None = None, settings: InferenceSettings | None = None) -> FastAPI:
    common = common or load_settings(CommonSettings, check_unknown=False)
    settings = settings or load_settings(InferenceSettings)
    app = create_service_app("inference", common)
    app.state.settings = settings
    return app
