"""OpenAI's Responses API (``/v1/responses``): thin, the logic is services/inference/responses.py.

Any key; a stored response is its tenant's alone (another tenant's id is a 404)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common.app_factory import json_or_sse
from services.common.auth import acting_principal
from services.common.response_store import ResponseStore
from services.common.responses_wire import ResponseDeleted, ResponseObject, ResponseRequest
from services.inference.api.deps import ServingDep
from services.inference.responses import InferenceResponses

router = APIRouter(
    tags=["responses"],
    responses={404: {"description": "no such model, or no such stored response of the caller's tenant"}},
)


def response_store(request: Request) -> ResponseStore:
    return ResponseStore(request.app.state.redis, request.app.state.service)


StoreDep = Annotated[ResponseStore, Depends(response_store)]


@router.post("/v1/responses", response_model=None, responses=json_or_sse(ResponseObject))
async def create_response(
    body: ResponseRequest, serving: ServingDep, store: StoreDep, request: Request
) -> JSONResponse | StreamingResponse:
    return await InferenceResponses(serving, store).create(body, request)


@router.get("/v1/responses/{response_id}", response_model=ResponseObject)
async def retrieve_response(response_id: str, store: StoreDep, request: Request) -> JSONResponse:
    stored = await store.load(acting_principal(request).tenant, response_id)
    return JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}", response_model=ResponseDeleted)
async def delete_response(response_id: str, store: StoreDep, request: Request) -> ResponseDeleted:
    await store.delete(acting_principal(request).tenant, response_id)
    return ResponseDeleted(id=response_id)
