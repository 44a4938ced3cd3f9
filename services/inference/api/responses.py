"""OpenAI's Responses API (``/v1/responses``): thin, the logic is services/inference/responses.py.

Any key; a stored response is its tenant's alone (another tenant's id is a 404). An operator key
acting for a tenant (``X-Tandem-Tenant``) stores and sees that tenant's."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common.app_factory import json_or_sse
from services.common.auth import acting_principal
from services.common.responses_routes import StoreDep, add_stored_response_routes
from services.common.responses_wire import ResponseObject, ResponseRequest
from services.inference.api.deps import ServingDep
from services.inference.responses import InferenceResponses

router = APIRouter(
    tags=["responses"],
    responses={404: {"description": "no such model, or no such stored response of the caller's tenant"}},
)


@router.post("/v1/responses", response_model=None, responses=json_or_sse(ResponseObject))
async def create_response(
    body: ResponseRequest, serving: ServingDep, store: StoreDep, request: Request
) -> JSONResponse | StreamingResponse:
    return await InferenceResponses(serving, store).create(body, request)


add_stored_response_routes(router, acting_principal)
