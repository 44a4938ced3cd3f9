"""The ``Engine`` protocol every backend (torch, vllm, remote) implements.

``generate`` is awaited first (it validates and enqueues, raising ``EngineError``s the
HTTP edge turns into 4xx), then its result is iterated for ``StreamEvent``s, one per
produced token (or text piece) per choice, the last of each choice carrying its
``finish_reason``. Closing the iterator early aborts the request and frees its slot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from services.inference.engine.types import EngineRequest, StreamEvent


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
