"""Retrieval's one client of an inference service's model routes (``/v1/embeddings``,
``/v1/rerank``): the remote embedder and reranker differ only in the routes they call.

Failures are named for the setting that chose the model: a model the server does not serve is
the caller's bad ``embedding_model``/``reranker_model`` (400), anything else the upstream's (502).
"""

from __future__ import annotations

from typing import Any

import httpx

from services.common.errors import InvalidRequest, UpstreamError
from services.common.telemetry import instrument_client
from services.common.upstream import UpstreamReply


class InferenceClient:
    def __init__(self, url: str, api_key: str, model: str, *, role: str, param: str, timeout: float) -> None:
        """``url`` with or without its ``/v1``; ``role`` names the server in messages ("embedding
        server"); ``param`` is the setting that named ``model``."""
        base = url.rstrip("/")
        self.url = base[: -len("/v1")] if base.endswith("/v1") else base
        self.model = model
        self.role = role
        self.param = param
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        instrument_client(self._http)  # traceparent on: the embedding call joins the caller's trace

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """The JSON body of a successful answer."""
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise UpstreamError(f"{self.role} {self.url} unreachable: {type(exc).__name__}: {exc}") from None
        if resp.status_code == 404:
            raise InvalidRequest(
                f"{self.param}: {self.model!r} is not served by the {self.role} {self.url}", param=self.param
            )
        if resp.status_code >= 400:
            message = UpstreamReply.of(self.role, resp).message
            raise UpstreamError(f"{self.role} {self.url} answered {resp.status_code}: {message}")
        return resp.json()
