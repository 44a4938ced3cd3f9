"""The model-management routes' logic: listing what a caller may use, LoRA adapters and
registered full models (the ``ModelRegistry``'s HTTP face). Engine errors arrive typed and
become OpenAI-shaped HTTP errors here, each naming the request field it is about."""

from __future__ import annotations

import time
from pathlib import Path

from services.common.auth import Principal
from services.common.errors import Conflict, InvalidRequest, NotFound, TandemError
from services.common.openai_wire import ModelCard, ModelList
from services.common.paths import resolve_under_roots
from services.inference import protocol as api
from services.inference.embeddings import EmbeddingService
from services.inference.engine.base import NameTaken
from services.inference.engine.types import EngineError
from services.inference.registry import ModelRegistry
from services.inference.serving import http_error

STARTED = int(time.time())


def _http(exc: EngineError, not_found_param: str | None = None) -> TandemError:
    """``http_error``, with a 404 naming ``not_found_param`` (the field that named the model)."""
    err = http_error(exc)
    if not_found_param is not None and err.status_code == 404:
        err.param = not_found_param
    return err


class ModelAdmin:
    def __init__(self, registry: ModelRegistry, embeddings: EmbeddingService, roots: list[Path]) -> None:
        self.registry = registry
        self.embeddings = embeddings
        self.roots = roots

    def _server_path(self, value: str, param: str) -> Path:
        path = resolve_under_roots(value, self.roots, param=param)
        try:
            exists = path.exists()
        except OSError as exc:  # a name longer than the file system allows: the client's value
            raise InvalidRequest(
                f"{param}: unusable path {value[:200]!r} ({exc.strerror})", param=param
            ) from None
        if not exists:
            raise InvalidRequest(f"{param}: {value!r} does not exist", param=param)
        return path

    async def list(self, principal: Principal) -> ModelList:
        """The served base models, shared fine-tunes, and the caller tenant's own."""
        try:
            served = await self.registry.models(principal)
        except EngineError as exc:
            raise http_error(exc) from None
        return ModelList(
            data=[
                ModelCard(
                    id=m.id,
                    created=STARTED,
                    owned_by=m.owned_by,
                    root=m.parent if m.kind == "registered" else (m.id if m.kind == "base" else None),
                    parent=m.parent if m.kind == "adapter" else None,
                    max_model_len=m.max_model_len,
                    kind="adapter"
                    if m.kind == "adapter"
                    else "registered"
                    if m.kind == "registered"
                    else "base",
                )
                for m in served
            ]
            # Embedding and rerank models (kind "embedding" / "rerank"), shared by every tenant.
            + self.embeddings.cards(STARTED)
        )

    async def card(self, model_id: str, principal: Principal) -> ModelCard:
        for card in (await self.list(principal)).data:
            if card.id == model_id:
                return card
        raise NotFound(f"The model `{model_id}` does not exist.", param="model", code="model_not_found")

    def capabilities(self) -> api.Capabilities:
        return api.Capabilities(**self.registry.capabilities())

    async def delete(self, model_id: str, principal: Principal) -> api.ModelDeleted:
        try:
            rec = await self.registry.remove(model_id, principal)
        except EngineError as exc:
            raise _http(exc, "model") from None
        return api.ModelDeleted(
            id=model_id, kind="registered" if rec is not None and rec.kind == "model" else "adapter"
        )

    async def load_adapter(self, body: api.LoadLoraRequest) -> api.AdapterLoaded:
        path = self._server_path(body.lora_path, "lora_path")
        try:
            await self.registry.load_adapter(body.lora_name, path, body.tenant or "", body.base)
        except NameTaken:
            raise Conflict(f"lora_name {body.lora_name!r} is already served", param="lora_name") from None
        except EngineError as exc:
            raise _http(exc, "base") from None
        return api.AdapterLoaded(lora_name=body.lora_name, lora_path=str(path), tenant=body.tenant or None)

    async def unload_adapter(self, body: api.UnloadLoraRequest, principal: Principal) -> api.AdapterUnloaded:
        try:
            await self.registry.remove(body.lora_name, principal, kind="adapter")
        except EngineError as exc:
            raise http_error(exc) from None
        return api.AdapterUnloaded(lora_name=body.lora_name)

    async def register(self, body: api.RegisterModelRequest) -> ModelCard:
        path = self._server_path(body.path, "path")
        try:
            await self.registry.register(body.name, path, body.tenant or "")
        except NameTaken:
            raise Conflict(f"a model named {body.name!r} is already served", param="name") from None
        except EngineError as exc:
            err = http_error(exc)
            if err.status_code == 503:  # the weights did not load: the path's fault
                raise InvalidRequest(
                    f"path {body.path!r} could not be loaded as a model: {exc}", param="path"
                ) from None
            raise err from None
        return ModelCard(
            id=body.name,
            created=int(time.time()),
            root=str(path),
            kind="registered",
            owned_by=body.tenant or "tandem",
        )

    async def unregister(
        self, body: api.UnregisterModelRequest, principal: Principal
    ) -> api.ModelUnregistered:
        try:
            await self.registry.remove(body.name, principal, kind="model")
        except EngineError as exc:
            raise _http(exc, "name") from None
        return api.ModelUnregistered(name=body.name)
