"""Builds the trainer service's FastAPI app (``uvicorn services.trainer.app:create_app --factory``)."""

from __future__ import annotations

from fastapi import FastAPI

from services.common.app_factory import create_service_app
from services.common.config import CommonSettings, load_settings
from services.trainer.config import TrainerSettings


def create_app(common: CommonSettings | None = None, settings: TrainerSettings | None = None) -> FastAPI:
    common = common or load_settings(CommonSettings, check_unknown=False)
    settings = settings or load_settings(TrainerSettings)
    app = create_service_app("trainer", common)
    app.state.settings = settings
    return app
