"""Builds the agent service's FastAPI app (``uvicorn services.agent.app:create_app --factory``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from services.agent.api import approvals as approvals_api
from services.agent.api import audit as audit_api
from services.agent.api import conversations, feedback, mcp_servers, openai_compat, pipelines, proxy, ws
from services.agent.api import evals as evals_api
from services.agent.api import promotions as promotions_api
from services.agent.api import quality as quality_api
from services.agent.api import responses as responses_api
from services.agent.api import signin as signin_api
from services.agent.api import users as users_api
from services.agent.api.web import mount_web
from services.agent.config import AgentSettings
from services.agent.evals.runs import Evaluations
from services.agent.evals.store import EvalStore
from services.agent.mcp_server import install_mcp, mcp_routers
from services.agent.runtime import AgentRuntime
from services.agent.tokens import load_counter
from services.common.app_factory import create_service_app
from services.common.config import CommonSettings, load_settings
from services.common.users import UserStore

DEFAULT_WEB_DIST = Path(__file__).parent / "web" / "dist"


def create_app(common: CommonSettings | None = None, settings: AgentSettings | None = None) -> FastAPI:
    common = common or load_settings(CommonSettings, check_unknown=False)
    settings = settings or load_settings(AgentSettings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Load the tokenizer (if one is configured) now, not in the first user's first-token latency.
        warm = asyncio.create_task(asyncio.to_thread(load_counter, settings.tokenizer))
        # The inference service withholds fine-tunes by the records in Redis: those kept before go there.
        await app.state.runtime.promotions.restrict_all()
        # Evaluates fine-tunes from feedback as they finish (services/agent/promotions.py).
        gate = asyncio.create_task(app.state.runtime.gate.run())
        try:
            async with app.state.mcp.session_manager.run():  # the MCP server at /mcp
                yield
        finally:
            warm.cancel()
            gate.cancel()
            app.state.evals.cancel()
            app.state.runtime.turns.close()

    mcp_keyed, mcp_public = mcp_routers()
    app = create_service_app(
        "agent",
        common,
        tenant_limits=settings.tenant_limits(),
        routers=[
            pipelines.router,
            approvals_api.router,
            conversations.router,
            feedback.router,
            quality_api.router,
            promotions_api.router,
            openai_compat.router,
            responses_api.router,
            ws.router,
            mcp_servers.router,
            evals_api.router,
            users_api.router,
            audit_api.router,
            signin_api.router,
            mcp_keyed,
        ],
        public_routers=[proxy.router, mcp_public, signin_api.public_router],
        lifespan=lifespan,
        # the proxy streams uploads on; the service behind it applies its own, lower, limit
        body_limits={
            proxy.ROUTE: (proxy.MAX_BODY_MB << 20, "the proxy's limit; the service behind it has its own")
        },
    )
    app.state.settings = settings
    app.state.runtime = AgentRuntime.create(common, settings, app.state.redis)
    app.state.users = UserStore(app.state.redis)  # people and their tokens (/v1/users)
    app.state.runtime.quality.register(app.state.metrics.registry)
    # evaluation sets and runs (/v1/evals), answered by the runtime's pipelines
    runtime = app.state.runtime
    app.state.evals = Evaluations(settings, EvalStore(app.state.redis), runtime.answers, runtime.promotions)
    install_mcp(app, app.state.runtime)
    # Last: every API route above wins over a file of the same path.
    mount_web(app, Path(settings.web_dist) if settings.web_dist else DEFAULT_WEB_DIST)
    return app
