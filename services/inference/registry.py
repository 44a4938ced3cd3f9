"""Which engine serves which ``model`` name: the primary engine (its base model and its
LoRA adapters) plus full models registered at run time (fine-tunes from the trainer)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from services.inference.engine.base import Engine, ServedModel
from services.inference.engine.types import AdapterError, UnknownModel

EngineBuilder = Callable[[str, Path], Awaitable[Engine]]


class ModelRegistry:
    def __init__(self, primary: Engine, builder: EngineBuilder | None = None) -> None:
        self.primary = primary
        self.builder = builder
        self.registered: dict[str, tuple[Engine, str]] = {}
        self._lock = asyncio.Lock()

    def engine_for(self, model: str) -> Engine:
        if model in self.registered:
            return self.registered[model][0]
        if self.primary.serves(model):
            return self.primary
        raise UnknownModel(f"The model `{model}` does not exist.")

    def engines(self) -> list[Engine]:
        return [self.primary, *(e for e, _ in self.registered.values())]

    async def models(self) -> list[ServedModel]:
        out = await self.primary.models()
        for name, (engine, path) in self.registered.items():
            for card in await engine.models():
                if card.kind == "base":
                    out.append(ServedModel(name, "registered", parent=path, max_model_len=card.max_model_len))
        return out

    async def register(self, name: str, path: Path) -> None:
        if self.builder is None:
            raise AdapterError(f"the {self.primary.kind} engine cannot load further models")
        async with self._lock:
            if name in self.registered or self.primary.serves(name):
                raise KeyError(name)
            engine = await self.builder(name, path)
            await engine.start()
            self.registered[name] = (engine, str(path))

    async def unregister(self, name: str) -> None:
        async with self._lock:
            if name not in self.registered:
                raise UnknownModel(f"The model `{name}` is not a registered model.")
            engine, _ = self.registered.pop(name)
        await engine.shutdown()

    async def shutdown(self) -> None:
        for engine in self.engines():
            await engine.shutdown()
