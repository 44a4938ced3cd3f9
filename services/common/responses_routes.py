"""``GET`` and ``DELETE /v1/responses/{id}``: a service's stored responses, each its tenant's
alone (another tenant's id is a 404), and its owner's where it was saved with one (another
member's is a 404 too), added to the router that serves ``POST /v1/responses``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from services.common.auth import Principal
from services.common.response_store import ResponseStore
from services.common.responses_wire import ResponseDeleted, ResponseObject


def response_store(request: Request) -> ResponseStore:
    return ResponseStore(request.app.state.redis, request.app.state.service)


StoreDep = Annotated[ResponseStore, Depends(response_store)]


def add_stored_response_routes(router: APIRouter, caller: Callable[[Request], Principal]) -> None:
    """``caller``: the principal whose tenant's responses a request sees."""

    @router.get("/v1/responses/{response_id}", response_model=ResponseObject)
    async def retrieve_response(response_id: str, store: StoreDep, request: Request) -> JSONResponse:
        who = caller(request)
        stored = await store.load(who.tenant, response_id, reader=who)
        return JSONResponse(stored.response)

    @router.delete("/v1/responses/{response_id}", response_model=ResponseDeleted)
    async def delete_response(response_id: str, store: StoreDep, request: Request) -> ResponseDeleted:
        who = caller(request)
        await store.delete(who.tenant, response_id, reader=who)
        return ResponseDeleted(id=response_id)
