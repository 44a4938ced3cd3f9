"""The services the agent calls, and the model a turn answers with when none is named.

``Upstreams`` makes the clients of retrieval, inference and the trainer, each carrying the
caller's own key (so every call is made with the caller's rights). ``ServedModels`` knows the
inference service's default model for chat (listed once, then kept) and checks a model a
caller names. Components receive these, not the runtime that holds them.
"""

from __future__ import annotations

import asyncio

from services.agent.clients import InferenceClient, RetrievalClient, TrainerClient
from services.common.config import CommonSettings
from services.common.errors import NotFound, ServiceUnavailable
from services.common.replicas import replica_pool


class Upstreams:
    """Clients of the other services for one caller's key."""

    def __init__(self, common: CommonSettings, timeout_s: float) -> None:
        self.common = common
        self.timeout_s = timeout_s

    def retrieval(self, api_key: str) -> RetrievalClient:
        return RetrievalClient(self.common.url_of("retrieval"), api_key, self.timeout_s)

    def inference(self, api_key: str) -> InferenceClient:
        # one pool for the process: every request shares the replicas' health and load
        pool = replica_pool(self.common.inference_replicas())
        return InferenceClient(pool, api_key, self.timeout_s)

    def trainer(self, api_key: str) -> TrainerClient:
        return TrainerClient(self.common.url_of("trainer"), api_key, self.timeout_s)


class ServedModels:
    """The default model for chat (``configured``, else the first shared model the inference
    service lists) and the check of a model a caller names."""

    def __init__(self, configured: str | None) -> None:
        self._default = configured or None
        self._lock = asyncio.Lock()

    async def default(self, inference: InferenceClient) -> str:
        if self._default:
            return self._default
        async with self._lock:
            if not self._default:
                models = await inference.models()
                if not models:
                    raise ServiceUnavailable("the inference service lists no model")
                # The list is per tenant (shared models plus the caller's fine-tunes): the default,
                # kept for every caller, must be a shared base model, never one tenant's adapter.
                shared = [m for m in models if m.kind in (None, "base")]
                self._default = (shared or models)[0].id
        return self._default

    async def check(self, inference: InferenceClient, llm: str) -> None:
        """``llm`` must be one of the models the inference service lists for the caller's key
        (shared base models and the tenant's own fine-tunes): anything else is a 404 naming it."""
        # Embedding and rerank models are listed too, but cannot write an answer.
        listed = {m.id for m in await inference.models() if m.kind not in ("embedding", "rerank")}
        if llm not in listed:
            raise NotFound(
                f"unknown model {llm!r} for 'llm': use one of the models GET /v1/models lists for this key",
                param="llm",
                code="model_not_found",
            )
