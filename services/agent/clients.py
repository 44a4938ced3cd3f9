"""HTTP clients of the retrieval and inference services.

The agent calls them with the *user's own* key, so tenant isolation is theirs to
enforce and follows automatically; ``service_client`` passes the request id on.
Upstream errors become typed errors here: a 404 from retrieval is an unknown
collection for the caller (404), a 4xx is the caller's bad input (400), anything
else is an upstream failure (502/503).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from services.agent.chunks import Chunk
from services.common.errors import (
    InvalidRequest,
    NotFound,
    ServiceUnavailable,
    TandemError,
    TooManyRequests,
    UpstreamError,
)
from services.common.http import service_client


def _upstream_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(body, dict) and body.get("detail"):
            return str(body["detail"])
    except (ValueError, json.JSONDecodeError):
        pass
    return resp.text[:300] or resp.reason_phrase


def upstream_error(service: str, resp: httpx.Response, param: str | None = None) -> TandemError:
    message = f"{service}: {_upstream_message(resp)}"
    if resp.status_code == 404:
        return NotFound(message, param=param)
    if resp.status_code == 429:
        return TooManyRequests(message, headers={"Retry-After": resp.headers.get("retry-after", "1")})
    if resp.status_code in (401, 403):
        return UpstreamError(f"{message} (the key was refused upstream)")
    if 400 <= resp.status_code < 500:
        return InvalidRequest(message, param=param)
    return UpstreamError(message)


def unreachable(service: str, exc: Exception) -> TandemError:
    return ServiceUnavailable(f"{service} service unreachable: {type(exc).__name__}: {exc}")


@dataclass
class Upstreams:
    retrieval_url: str
    inference_url: str
    timeout: float = 120.0


class RetrievalClient:
    def __init__(self, base_url: str, api_key: str, timeout: float = 60.0) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.timeout = timeout

    def _client(self) -> httpx.AsyncClient:
        return service_client(self.base_url, self.api_key, self.timeout)

    async def search(
        self,
        collection: str,
        query: str,
        *,
        top_k: int = 10,
        mode: str = "hybrid",
        rerank: bool = False,
        filters: dict[str, Any] | None = None,
    ) -> list[Chunk]:
        body: dict[str, Any] = {"query": query, "top_k": top_k, "mode": mode}
        if rerank:
            body["rerank"] = True
        if filters:
            body["filters"] = filters
        try:
            async with self._client() as client:
                resp = await client.post(f"/v1/collections/{collection}/search", json=body)
        except httpx.HTTPError as exc:
            raise unreachable("retrieval", exc) from exc
        if resp.status_code == 404:
            raise NotFound(f"unknown collection {collection!r}", param="collection")
        if resp.status_code >= 400:
            raise upstream_error("retrieval", resp, param="collection")
        return [Chunk.from_result(item) for item in resp.json().get("results", [])]

    async def embedding_model(self, collection: str) -> str:
        """The embedding model ``collection`` was built with (as the inference service names it)."""
        try:
            async with self._client() as client:
                resp = await client.get(f"/v1/collections/{collection}")
        except httpx.HTTPError as exc:
            raise unreachable("retrieval", exc) from exc
        if resp.status_code >= 400:
            raise upstream_error("retrieval", resp, param="collection")
        return str(resp.json()["embedding_model"])

    async def document_titles(self, collection: str, document_ids: list[str]) -> dict[str, str]:
        """Titles of documents (best effort: search hits may not carry them)."""
        out: dict[str, str] = {}
        try:
            async with self._client() as client:
                for doc_id in dict.fromkeys(document_ids):
                    resp = await client.get(f"/v1/collections/{collection}/documents/{doc_id}")
                    if resp.status_code == 200:
                        body = resp.json()
                        meta = body.get("metadata") or {}
                        title = body.get("title") or (meta.get("title") if isinstance(meta, dict) else "")
                        if title:
                            out[doc_id] = str(title)
        except httpx.HTTPError:
            pass
        return out


class InferenceClient:
    """OpenAI-style chat completions, streamed."""

    def __init__(self, base_url: str, api_key: str, timeout: float = 120.0) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.timeout = timeout

    def _client(self) -> httpx.AsyncClient:
        return service_client(self.base_url, self.api_key, self.timeout)

    async def models(self) -> list[dict[str, Any]]:
        try:
            async with self._client() as client:
                resp = await client.get("/v1/models")
        except httpx.HTTPError as exc:
            raise unreachable("inference", exc) from exc
        if resp.status_code >= 400:
            raise upstream_error("inference", resp)
        return list(resp.json().get("data", []))

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            async with self._client() as client:
                resp = await client.post("/v1/chat/completions", json={**body, "stream": False})
        except httpx.HTTPError as exc:
            raise unreachable("inference", exc) from exc
        if resp.status_code >= 400:
            raise upstream_error("inference", resp)
        return dict(resp.json())

    async def embed(self, model: str, texts: list[str]) -> list[list[float]]:
        """``/v1/embeddings``: one vector per text, in order (L2-normalised by the service)."""
        try:
            async with self._client() as client:
                resp = await client.post("/v1/embeddings", json={"model": model, "input": texts})
        except httpx.HTTPError as exc:
            raise unreachable("inference", exc) from exc
        if resp.status_code >= 400:
            raise upstream_error("inference", resp, param="model")
        data = sorted(resp.json()["data"], key=lambda d: d["index"])
        return [list(map(float, d["embedding"])) for d in data]

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Yields the chunk objects of an SSE stream; leaving early closes the connection,
        which the inference service takes as a disconnect and frees the slot."""
        try:
            async with (
                self._client() as client,
                client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp,
            ):
                if resp.status_code >= 400:
                    await resp.aread()
                    raise upstream_error("inference", resp)
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(chunk, dict) and "error" in chunk:
                        err = chunk["error"]
                        raise UpstreamError(
                            f"inference: {err.get('message') if isinstance(err, dict) else err}"
                        )
                    yield chunk
        except httpx.HTTPError as exc:
            raise unreachable("inference", exc) from exc


class TrainerClient:
    """The trainer's dataset and job API, called with the caller's own key (so files and jobs
    belong to the caller's tenant)."""

    def __init__(self, base_url: str, api_key: str, timeout: float = 120.0) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.timeout = timeout

    def _client(self) -> httpx.AsyncClient:
        return service_client(self.base_url, self.api_key, self.timeout)

    async def upload_file(self, filename: str, data: bytes) -> dict[str, Any]:
        """POST /v1/files (multipart): the trainer checks every row before it stores the file."""
        try:
            async with self._client() as client:
                resp = await client.post("/v1/files", files={"file": (filename, data, "application/jsonl")})
        except httpx.HTTPError as exc:
            raise unreachable("trainer", exc) from exc
        if resp.status_code >= 400:
            raise upstream_error("trainer", resp, param="format")
        return dict(resp.json())

    async def create_job(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            async with self._client() as client:
                resp = await client.post("/v1/jobs", json=body)
        except httpx.HTTPError as exc:
            raise unreachable("trainer", exc) from exc
        if resp.status_code >= 400:
            param = None
            with contextlib.suppress(ValueError, AttributeError):
                param = (resp.json().get("error") or {}).get("param")
            raise upstream_error("trainer", resp, param=param)
        return dict(resp.json())
