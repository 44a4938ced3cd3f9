"""Builds the inference service's FastAPI app (``uvicorn services.inference.app:create_app --factory``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from services.common.app_factory import create_service_app
from services.common.config import CommonSettings, load_settings
from services.common.errors import ServiceUnavailable
from services.inference.api.embeddings import router as embeddings_router
from services.inference.api.openai import router
from services.inference.api.responses import router as responses_router
from services.inference.config import InferenceSettings
from services.inference.embeddings import EmbeddingService
from services.inference.engine.base import Engine
from services.inference.engines import build_engine, torch_builder
from services.inference.metrics import install as install_engine_metrics
from services.inference.registry import ModelRegistry, RecordStore


def create_app(
    common: CommonSettings | None = None,
    settings: InferenceSettings | None = None,
    engine: Engine | None = None,
) -> FastAPI:
    """``engine`` lets tests (and embedders) hand in a ready engine instead of loading one."""
    common = common or load_settings(CommonSettings, check_unknown=False)
    settings = settings or load_settings(InferenceSettings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        primary = engine or await build_engine(settings, common)
        await primary.start()
        builder = torch_builder(settings, common) if primary.kind == "torch" else None
        app.state.registry = ModelRegistry(
            primary,
            builder,
            RecordStore(app.state.redis),
            max_adapters=settings.max_adapters,
            max_lora_rank=settings.max_lora_rank,
        )
        try:
            yield
        finally:
            await app.state.registry.shutdown()
            app.state.registry = None
            app.state.embeddings.close()

    async def engine_ready() -> None:
        registry = getattr(app.state, "registry", None)
        if registry is None:
            raise ServiceUnavailable("the model is still loading")
        await registry.primary.health()

    app = create_service_app(
        "inference",
        common,
        routers=[router, embeddings_router, responses_router],
        readiness={"engine": engine_ready},
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.registry = None
    app.state.engine_metrics = install_engine_metrics(app)  # vllm:* on /metrics
    app.state.embeddings = EmbeddingService(settings, common.allowed_model_roots, common.device)
    return app
