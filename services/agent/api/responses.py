"""OpenAI's Responses API on the agent service (``/v1/responses``): ``model`` names a pipeline or
agent. Thin: the logic is services/agent/responses.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse

from services.agent.api.common import sse_response
from services.agent.api.deps import CallerDep, RuntimeDep
from services.agent.api.openai_compat import _failed_turn as failed_turn
from services.agent.events import ErrorEvent
from services.agent.responses import AgentResponseRequest, AgentResponses
from services.common.app_factory import json_or_sse
from services.common.auth import principal_of
from services.common.responses_routes import StoreDep, add_stored_response_routes
from services.common.responses_wire import ResponseObject

router = APIRouter(
    tags=["responses"],
    responses={404: {"description": "no such pipeline, agent, collection, MCP server or stored response"}},
)


async def _bytes(events: AsyncIterator[str]) -> AsyncIterator[bytes]:
    async for frame in events:
        yield frame.encode()


@router.post("/v1/responses", response_model=None, responses=json_or_sse(ResponseObject))
async def create_response(
    body: AgentResponseRequest, runtime: RuntimeDep, who: CallerDep, store: StoreDep
) -> JSONResponse | StreamingResponse:
    responses = AgentResponses(runtime, *who, store, body)
    chat = await responses.start()
    if body.stream:
        return sse_response(_bytes(await responses.stream(chat)))
    answer = await responses.answer(chat)
    if isinstance(answer, ErrorEvent):
        return failed_turn(answer)
    return JSONResponse(answer.model_dump(mode="json"))


add_stored_response_routes(router, principal_of)
