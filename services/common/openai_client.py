"""The one client of OpenAI-compatible HTTP APIs (Tandem's inference service, vLLM, OpenAI...),
over one or several replicas of the server (see :mod:`services.common.replicas`).

Async callers use :meth:`OpenAIClient.request` and :meth:`~OpenAIClient.stream`; synchronous
ones (retrieval's embedder and reranker, in worker threads) :meth:`~OpenAIClient.request_sync`,
with the same replicas, retry and errors. It raises what :mod:`services.common.upstream`
defines (an error status as :class:`UpstreamStatus`, an unreadable answer as
:class:`UpstreamBroken`) and httpx's own errors when no replica could be reached; each caller
maps those to its own errors (the agent to HTTP errors with
:func:`~services.common.upstream.tandem_error`, the remote engine to engine errors, retrieval
with :func:`~services.common.upstream.model_server_errors`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncGenerator, Sequence
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from services.common.http import service_client, sync_service_client
from services.common.jsonsafe import JsonObject
from services.common.openai_stream import Chunk, openai_chunks
from services.common.replicas import ReplicaPool, api_root
from services.common.upstream import UpstreamBroken, UpstreamReply, UpstreamStatus

Model = TypeVar("Model", bound=BaseModel)


class OpenAIClient:
    """``persistent``: one connection pool for the client's life (close it with :meth:`aclose`,
    and :meth:`close` after synchronous calls); otherwise a connection per call, for clients made
    per request (the agent's, with the caller's key)."""

    def __init__(
        self,
        replicas: ReplicaPool | str | Sequence[str],
        api_key: str = "",
        *,
        service: str = "inference",
        timeout: float | httpx.Timeout = 120.0,
        persistent: bool = False,
    ) -> None:
        if isinstance(replicas, ReplicaPool):
            self.pool = replicas
        else:
            self.pool = ReplicaPool([replicas] if isinstance(replicas, str) else replicas, service=service)
        self.service = service
        self.api_key = api_key
        self.timeout = timeout
        self.persistent = persistent
        # each pool made on its first call, so a client used one way only holds one
        self._shared: httpx.AsyncClient | None = None
        self._shared_sync: httpx.Client | None = None
        self._sync_lock = threading.Lock()  # worker threads may make the first calls at once

    async def aclose(self) -> None:
        if self._shared is not None:
            await self._shared.aclose()
        self.close()

    def close(self) -> None:
        if self._shared_sync is not None:
            self._shared_sync.close()

    def _http(self) -> contextlib.AbstractAsyncContextManager[httpx.AsyncClient]:
        if not self.persistent:
            return service_client("", self.api_key, self.timeout)
        if self._shared is None:
            self._shared = service_client("", self.api_key, self.timeout)
        return contextlib.nullcontext(self._shared)

    def _http_sync(self) -> contextlib.AbstractContextManager[httpx.Client]:
        if not self.persistent:
            return sync_service_client("", self.api_key, self.timeout)
        with self._sync_lock:
            if self._shared_sync is None:
                self._shared_sync = sync_service_client("", self.api_key, self.timeout)
            return contextlib.nullcontext(self._shared_sync)

    def _status(self, resp: httpx.Response) -> UpstreamStatus:
        return UpstreamStatus(UpstreamReply.of(self.service, resp))

    def _json(self, resp: httpx.Response, path: str) -> Any:
        """The JSON of a (read) answer; an error status or no JSON raises."""
        if resp.status_code >= 400:
            raise self._status(resp)
        try:
            return resp.json()
        except ValueError:
            raise UpstreamBroken(f"{self.service} answered {path} with no JSON") from None

    async def request(
        self, method: str, path: str, body: JsonObject | None = None, *, idempotent: bool = True
    ) -> Any:
        """The JSON answer of ``{replica}/v1{path}``."""
        for attempt in self.pool.attempts(idempotent=idempotent):
            with attempt:
                async with self._http() as http:
                    resp = await http.request(method, api_root(attempt.url) + path, json=body)
                return self._json(resp, path)
        raise RuntimeError(f"{self.service}: no replica was tried")  # attempts() always yields one

    def request_sync(
        self, method: str, path: str, body: JsonObject | None = None, *, idempotent: bool = True
    ) -> Any:
        """:meth:`request` for synchronous code: the same replicas, retry and errors, and the
        caller's trace goes on (a client span per call)."""
        for attempt in self.pool.attempts(idempotent=idempotent):
            with attempt, self._http_sync() as http:
                return self._json(http.request(method, api_root(attempt.url) + path, json=body), path)
        raise RuntimeError(f"{self.service}: no replica was tried")  # attempts() always yields one

    async def request_as(
        self, kind: type[Model], method: str, path: str, body: JsonObject | None = None
    ) -> Model:
        """:meth:`request`'s answer as ``kind``; another shape is :class:`UpstreamBroken`."""
        data = await self.request(method, path, body)
        try:
            return kind.model_validate(data)
        except ValidationError as exc:
            raise UpstreamBroken(f"{self.service} answered {path} in an unexpected shape: {exc}") from None

    async def stream(self, path: str, body: JsonObject, kind: type[Chunk]) -> AsyncGenerator[Chunk, None]:
        """The chunks of ``POST {replica}/v1{path}`` with ``stream: true``. Chunks without output
        (the opening role chunk) are held until the first one with output: a replica that dies
        before then leaves no trace, and the request goes once to another. Leaving early closes
        the connection, which the server takes as a disconnect and frees the slot."""
        for attempt in self.pool.attempts():
            with attempt:
                held: list[Chunk] = []
                async with (
                    self._http() as http,
                    http.stream("POST", api_root(attempt.url) + path, json={**body, "stream": True}) as resp,
                ):
                    if resp.status_code >= 400:
                        await resp.aread()
                        raise self._status(resp)
                    try:
                        async for chunk in openai_chunks(resp.aiter_lines(), kind):
                            if not attempt.committed:
                                if not chunk.has_output():
                                    held.append(chunk)
                                    continue
                                attempt.commit()
                                for early in held:
                                    yield early
                            yield chunk
                    except httpx.HTTPError as exc:
                        if not attempt.committed:
                            raise  # nothing was seen: the attempt goes to another replica
                        # Tokens went out already: the stream is cut, not the replica unreachable
                        # (the same error as a stream that ends without [DONE]).
                        raise UpstreamBroken(
                            f"{self.service}'s stream was cut after its first tokens ({type(exc).__name__})"
                        ) from exc
                if not attempt.committed:  # a complete stream without output (no tokens asked for)
                    for early in held:
                        yield early
                return
