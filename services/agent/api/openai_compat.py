"""OpenAI-compatible facade: ``model`` names a pipeline or agent, ``collection`` is an extra field.

The routes read the request and answer in HTTP; the turn itself, and OpenAI's shapes of its answer
and stream, are services/agent/openai_chat.py's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse

from services.agent.api.common import sse, sse_response
from services.agent.api.deps import CallerDep, RuntimeDep
from services.agent.events import ErrorEvent
from services.agent.openai_chat import OpenAIChat, model_list
from services.agent.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    OpenAIModelList,
    StreamError,
)
from services.common.app_factory import JSON_OR_SSE
from services.common.errors import error_body

router = APIRouter(tags=["openai"], responses={404: {"description": "no such model or collection"}})


@router.get("/v1/models")
async def models(runtime: RuntimeDep) -> OpenAIModelList:
    return model_list(runtime)


# HTTP status of a turn that ended in an error event rather than an exception (whose status the
# event carries): the agent's budgets. A 5xx, as OpenAI answers a generation it could not finish;
# the `openai` client retries those (max_retries), which may help where sampling is on.
_FAILED_TURN_STATUS = {"time_budget_exceeded": 504, "step_budget_exceeded": 500}


def _failed_turn(error: ErrorEvent) -> JSONResponse:
    """A turn that failed is an error in OpenAI's shape, never a 200 with a cut answer."""
    status = error.status or _FAILED_TURN_STATUS.get(error.code or "", 500)
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(type_, error.message, error.param, error.code), status_code=status)


async def _frames(chunks: AsyncIterator[ChatCompletionChunk | StreamError]) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        yield sse(chunk)
    yield b"data: [DONE]\n\n"


@router.post("/v1/chat/completions", response_model=None, responses=JSON_OR_SSE)
async def chat_completions(
    body: ChatCompletionRequest, runtime: RuntimeDep, who: CallerDep
) -> ChatCompletion | JSONResponse | StreamingResponse:
    chat = OpenAIChat(runtime, *who, body)
    if body.stream:
        return sse_response(_frames(await chat.stream()))
    answer = await chat.answer()
    return _failed_turn(answer) if isinstance(answer, ErrorEvent) else answer
