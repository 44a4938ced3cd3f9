"""The ``Engine`` protocol every backend (torch, vllm, remote) implements.

``generate`` is awaited first (it validates and enqueues, raising ``EngineError``s the
HTTP edge turns into 4xx), then its result is iterated for ``StreamEvent``s, one per
produced token (or text piece) per choice, the last of each choice carrying its
``finish_reason``. Closing the iterator early aborts the request and frees its slot.

Errors are typed, so the HTTP edge maps them by class, never by their text: ``NameTaken``
(409), ``AdapterNotFound`` (404), ``AdapterError`` (a path that is not a loadable adapter,
400) and the rest of ``engine.types``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from services.inference.engine.types import EngineError, EngineRequest, StreamEvent, UnknownModel


class NameTaken(EngineError):
    """An adapter or model of this name is already served (HTTP 409)."""

    def __init__(self, name: str, message: str | None = None) -> None:
        super().__init__(message or f"an adapter or model named {name!r} is already loaded")
        self.name = name


class AdapterNotFound(UnknownModel):
    """No adapter of this name is served here (HTTP 404 ``adapter_not_found``)."""

    def __init__(self, name: str, message: str | None = None) -> None:
        super().__init__(message or f"no adapter named {name!r} is loaded")
        self.name = name


@dataclass
class ServedModel:
    id: str
    # "base" | "adapter" | "registered"
    kind: str
    parent: str | None = None
    max_model_len: int | None = None
    owned_by: str = "tandem"


@runtime_checkable
class Engine(Protocol):
    kind: str

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    async def generate(self, request: EngineRequest) -> AsyncIterator[StreamEvent]: ...

    async def abort(self, request_id: str) -> None: ...

    async def health(self) -> dict[str, object]:
        """Raises when the engine cannot serve; else a small status dict."""
        ...

    async def models(self) -> list[ServedModel]: ...

    def serves(self, model: str) -> bool: ...

    async def load_adapter(self, name: str, path: str) -> None: ...

    async def unload_adapter(self, name: str) -> None: ...


class AdapterHost:
    """What the torch, llama.cpp and vLLM engines share: one base model ``name`` with LoRA ``adapters``
    (name -> the engine's handle) loaded onto it, served under their own names."""

    name: str
    max_model_len: int
    adapters: dict[str, Any]

    def serves(self, model: str) -> bool:
        return model == self.name or model in self.adapters

    async def models(self) -> list[ServedModel]:
        out = [ServedModel(self.name, "base", max_model_len=self.max_model_len)]
        out += [
            ServedModel(a, "adapter", parent=self.name, max_model_len=self.max_model_len)
            for a in self.adapters
        ]
        return out

    def check_free(self, name: str) -> None:
        """Raises ``NameTaken`` when ``name`` is the base model's or a loaded adapter's."""
        if name in self.adapters or name == self.name:
            raise NameTaken(name)

    def check_loaded(self, name: str) -> None:
        """Raises ``AdapterNotFound`` unless an adapter ``name`` is loaded."""
        if name not in self.adapters:
            raise AdapterNotFound(name)
