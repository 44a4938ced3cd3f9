"""What another service answered, read once, and the one mapping of it to this service's errors.

Every HTTP client of the stack (the agent's, the remote engine's, the trainer's, the CLI's) reads
an upstream error reply with :meth:`UpstreamReply.of`: OpenAI's ``{"error": {"message": ...}}``,
FastAPI's ``{"detail": ...}`` or plain text, whichever came. A caller that answers its own
clients with the upstream's failure maps it with :func:`upstream_error`: a 404 stays a 404, a
429 keeps its Retry-After, a refused key is *this* service's upstream problem (502, never the
caller's 401), another 4xx is the caller's bad input (400), anything else a 502.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from services.common import errors
from services.common.errors import TandemError
from services.common.jsonsafe import JsonObject


def error_message(body: Any) -> str:
    """The message of an error body in OpenAI's or FastAPI's shape; empty when it has none."""
    if not isinstance(body, dict):
        return ""
    err = body.get("error")
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    if isinstance(err, str) and err:
        return err
    return str(body["detail"]) if body.get("detail") else ""


@dataclass(frozen=True)
class UpstreamReply:
    """An upstream's answer with a status of 400 or more."""

    service: str
    status_code: int
    message: str
    # The JSON object it answered (OpenAI's error shape from Tandem, vLLM, OpenAI); None for text.
    body: JsonObject | None = None
    retry_after: str | None = None

    @classmethod
    def of(cls, service: str, resp: httpx.Response) -> UpstreamReply:
        """``resp`` must have been read (``read()``/``aread()`` for a streamed response)."""
        try:
            parsed = json.loads(resp.content)
        except ValueError:
            parsed = None
        body = parsed if isinstance(parsed, dict) else None
        message = error_message(body) or resp.text[:300] or resp.reason_phrase
        return cls(service, resp.status_code, message, body, resp.headers.get("retry-after"))

    @property
    def param(self) -> str | None:
        err = (self.body or {}).get("error")
        return str(err["param"]) if isinstance(err, dict) and err.get("param") else None


class UpstreamFailed(Exception):
    """Base of what the shared clients raise; :func:`tandem_error` maps each to an HTTP error."""


class UpstreamStatus(UpstreamFailed):
    """The upstream answered with an error status."""

    def __init__(self, reply: UpstreamReply) -> None:
        super().__init__(f"{reply.service} answered {reply.status_code}: {reply.message}")
        self.reply = reply


class UpstreamBroken(UpstreamFailed):
    """The answer could not be read: a stream carried an error object or a malformed chunk, or
    ended before ``[DONE]``; a JSON answer was not the shape expected."""

    def __init__(self, message: str, *, truncated: bool = False) -> None:
        super().__init__(message)
        # ended without [DONE] (the replica died or the connection dropped): the request may be
        # retried elsewhere if nothing of it reached the caller yet
        self.truncated = truncated


def upstream_error(reply: UpstreamReply, param: str | None = None) -> TandemError:
    message = f"{reply.service}: {reply.message}"
    status = reply.status_code
    if status == 404:
        return errors.NotFound(message, param=param)
    if status == 429:
        return errors.TooManyRequests(message, headers={"Retry-After": reply.retry_after or "1"})
    if status in (401, 403):
        return errors.UpstreamError(f"{message} (the key was refused upstream)")
    if 400 <= status < 500:
        return errors.InvalidRequest(message, param=param)
    return errors.UpstreamError(message)


def unreachable(service: str, exc: Exception, param: str | None = None) -> TandemError:
    """``param``: the request field that made the call (a collection to read, say), if one did."""
    return errors.ServiceUnavailable(
        f"{service} service unreachable: {type(exc).__name__}: {exc}", param=param
    )


def tandem_error(
    service: str, exc: UpstreamFailed | httpx.HTTPError, param: str | None = None
) -> TandemError:
    """The HTTP error a caller answers for a failed upstream call."""
    if isinstance(exc, UpstreamStatus):
        return upstream_error(exc.reply, param)
    if isinstance(exc, UpstreamBroken):
        return errors.UpstreamError(f"{service}: {exc}")
    return unreachable(service, exc)


@contextmanager
def model_server_errors(server: str, url: str, *, model: str, param: str) -> Iterator[None]:
    """A failed call to a model server made inside, as the caller's error. ``model`` is what the
    setting ``param`` (``embedding_model``, ...) named: a model the server does not serve (its
    404) is that setting's fault (400); anything else is the server's (502), named by ``server``
    ("embedding server") and ``url``."""
    try:
        yield
    except UpstreamStatus as exc:
        status = exc.reply.status_code
        if status == 404:
            raise errors.InvalidRequest(
                f"{param}: {model!r} is not served by the {server} {url}", param=param
            ) from None
        raise errors.UpstreamError(f"{server} {url} answered {status}: {exc.reply.message}") from None
    except UpstreamBroken as exc:
        raise errors.UpstreamError(f"{server} {url}: {exc}") from None
    except httpx.HTTPError as exc:
        raise errors.UpstreamError(f"{server} {url} unreachable: {type(exc).__name__}: {exc}") from None
