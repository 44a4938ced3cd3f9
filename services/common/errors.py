"""Typed errors and the one JSON error shape of every service.

Code below the HTTP edge raises ``TandemError`` subclasses; ``install_error_handlers``
turns them (and FastAPI's own validation errors) into

    {"error": {"type": ..., "message": ..., "param": ..., "code": ...}}

which is also the shape OpenAI's API uses, so the official clients parse it.
Bad input never becomes a 500: only a bug does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, TypedDict

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("tandem.errors")


class TandemError(Exception):
    status_code = 400
    type = "invalid_request_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def to_dict(self) -> ErrorJson:
        return error_body(self.type, self.message, self.param, self.code)


class InvalidRequest(TandemError):
    status_code = 400


class Unauthorized(TandemError):
    status_code = 401
    type = "authentication_error"


class Forbidden(TandemError):
    status_code = 403
    type = "permission_error"


class NotFound(TandemError):
    status_code = 404
    type = "not_found_error"


class Conflict(TandemError):
    status_code = 409
    type = "conflict_error"


class Gone(TandemError):
    """It existed, and no longer may be used (an expired approval): unlike a 404, asking again will
    not help."""

    status_code = 410
    type = "gone_error"


class PayloadTooLarge(TandemError):
    status_code = 413


class InsufficientStorage(TandemError):
    """The tenant's storage quota would be passed (RFC 4918's 507)."""

    status_code = 507
    type = "quota_exceeded_error"


class UnsupportedMediaType(TandemError):
    status_code = 415


class TooManyRequests(TandemError):
    status_code = 429
    type = "rate_limit_error"


class ServiceUnavailable(TandemError):
    status_code = 503
    type = "service_unavailable"


class UpstreamError(TandemError):
    """A service this one depends on failed or answered badly."""

    status_code = 502
    type = "upstream_error"


class ErrorDetail(BaseModel):
    type: str
    message: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The one error shape, for the OpenAPI schema (``error_body`` builds it)."""

    error: ErrorDetail


class ErrorFields(TypedDict):
    """``ErrorDetail`` as JSON."""

    type: str
    message: str
    param: str | None
    code: str | None


class ErrorJson(TypedDict):
    """``ErrorResponse`` as JSON: what every 4xx/5xx body and stream error event holds."""

    error: ErrorFields


def error_body(type_: str, message: str, param: str | None = None, code: str | None = None) -> ErrorJson:
    return {"error": {"type": type_, "message": message, "param": param, "code": code}}


def _short(value: Any, limit: int = 120) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Pydantic names the member of a union it tried ("constrained-str", "list[constrained-int]"); a
# client knows the field, not the validator's member, so these are left out of `param`.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "tuple", "set", "none"})


def _is_union_tag(part: str) -> bool:
    return (
        part in _UNION_TAGS or "[" in part or part.startswith(("constrained-", "function-", "lax-or-strict"))
    )


def _param_name(loc: Sequence[int | str]) -> str | None:
    """The field a client sent, as ``a.0.b``: union members left out, and a trailing item index
    dropped (an item of a list of numbers or strings is reported as the list, as OpenAI does)."""
    parts = [p for p in loc if isinstance(p, int) or not _is_union_tag(p)]
    while parts and isinstance(parts[-1], int):
        parts.pop()
    return ".".join(str(p) for p in parts) or None


def describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence naming each offending field and value."""
    parts = []
    first_param: str | None = None
    for err in exc.errors():
        loc = list(err.get("loc", ()))
        # The first element says where the value came from (body, query string, ...), not its name.
        if loc and loc[0] in ("body", "query", "path", "header", "cookie"):
            loc = loc[1:]
        param = _param_name(loc)
        first_param = first_param or param
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            parts.append(f"malformed JSON body: {ctx.get('error', 'could not parse')}")
            continue
        if "input" in err and err.get("type") != "missing":
            parts.append(f"{param or 'body'}: {err['msg']} (got {_short(err['input'])})")
        else:
            parts.append(f"{param or 'body'}: {err['msg']}")
    return "; ".join(parts) or "invalid request", first_param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TandemError)
    async def _tandem(_: Request, exc: TandemError) -> JSONResponse:
        return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(exc)
        return JSONResponse(error_body("invalid_request_error", message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error" if exc.status_code < 500 else "internal_error"
        )
        return JSONResponse(
            error_body(type_, str(exc.detail)), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            error_body("internal_error", f"internal error: {type(exc).__name__}"), status_code=500
        )
