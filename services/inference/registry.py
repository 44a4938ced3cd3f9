"""Which engine serves which ``model`` name, durably and per tenant.

The primary engine serves its base model. Published fine-tunes (LoRA adapters) and
registered full models are *records* in Redis, so every replica sharing that Redis and
the model storage serves them, and a restart loses none of them::

    tandem:models:<name>  -> hash {name, kind: adapter|model, tenant ("" = shared), path,
                                   base, rank, created_at}
    tandem:models:names   -> set of names

A replica loads a record's weights on first use: adapters onto their base engine (the
primary, or a registered full model), at most ``max_adapters`` resident at once (the
least recently used adapter with no running request is unloaded first); full models as
engines of their own (``builder``). Every request reads the record again (one Redis
round trip), so a fine-tune deleted through any replica stops answering on all of them.

Tenants: a record with a tenant is visible (listed, usable, deletable) to that tenant
only; others are told it does not exist. Shared records (tenant "") are the operator's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from services.common.auth import Principal
from services.inference.engine.base import AdapterNotFound, Engine, NameTaken, ServedModel
from services.inference.engine.types import (
    AdapterError,
    EngineError,
    EngineUnavailable,
    StreamEvent,
    UnknownModel,
)

log = logging.getLogger(__name__)

EngineBuilder = Callable[[str, Path], Awaitable[Engine]]
RECORD_PREFIX = "tandem:models:"
NAMES_KEY = "tandem:models:names"
RESERVED_NAMES = frozenset({"names"})  # would collide with the index set's key


class NotPermitted(EngineError):
    """The caller sees the model but may not change it (a shared model, a non-operator key)."""


@dataclass(frozen=True)
class ModelRecord:
    name: str
    kind: str  # "adapter" | "model"
    tenant: str  # "" = shared (the operator's)
    path: str
    base: str  # adapters: the model they apply to; models: ""
    rank: int | None
    created_at: float

    def to_hash(self) -> dict[str, str]:
        # Redis hash fields are text: no rank is ""; str() of a float round-trips exactly
        return {k: "" if v is None else str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_hash(cls, data: dict[str, str]) -> ModelRecord | None:
        if not data.get("kind") or not data.get("path"):
            return None
        return cls(
            name=data["name"],
            kind=data["kind"],
            tenant=data.get("tenant", ""),
            path=data["path"],
            base=data.get("base", ""),
            rank=int(data["rank"]) if data.get("rank") else None,
            created_at=float(data.get("created_at") or 0),
        )

    def visible_to(self, principal: Principal) -> bool:
        return not self.tenant or self.tenant == principal.tenant

    @property
    def owner(self) -> str:
        return self.tenant or "tandem"


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RecordStore:
    """The Redis side of the registry."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.r = client

    async def get(self, name: str) -> ModelRecord | None:
        raw = await self.r.hgetall(RECORD_PREFIX + name)
        return ModelRecord.from_hash({_text(k): _text(v) for k, v in raw.items()})

    async def create(self, rec: ModelRecord) -> bool:
        """Write ``rec`` unless its name is taken (by any replica): HSETNX is the claim."""
        key = RECORD_PREFIX + rec.name
        if not await self.r.hsetnx(key, "name", rec.name):
            return False
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(key, mapping=rec.to_hash())  # type: ignore[arg-type]  # str->str is fine; the stub is invariant
        pipe.sadd(NAMES_KEY, rec.name)
        await pipe.execute()
        return True

    async def remove(self, name: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(RECORD_PREFIX + name)
        pipe.srem(NAMES_KEY, name)
        await pipe.execute()

    async def all(self) -> list[ModelRecord]:
        names = sorted(_text(n) for n in await self.r.smembers(NAMES_KEY))
        if not names:
            return []
        pipe = self.r.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(RECORD_PREFIX + name)
        out = []
        for raw in await pipe.execute():
            rec = ModelRecord.from_hash({_text(k): _text(v) for k, v in raw.items()})
            if rec is not None:
                out.append(rec)
        return out


def adapter_rank(path: Path) -> int | None:
    """``r`` from a PEFT adapter's config (None when unreadable: loading reports why)."""
    try:
        value = json.loads((path / "adapter_config.json").read_text()).get("r")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) else None


class Leased:
    """An engine stream that gives its adapter back (running-request count) when it ends,
    is closed, or is dropped unread."""

    def __init__(self, stream: AsyncIterator[StreamEvent], release: Callable[[], None]) -> None:
        self._stream = stream
        self._release: Callable[[], None] | None = release

    def _done(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __aiter__(self) -> Leased:
        return self

    async def __anext__(self) -> StreamEvent:
        try:
            return await self._stream.__anext__()
        except BaseException:
            self._done()
            raise

    async def aclose(self) -> None:
        self._done()
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            await aclose()

    def __del__(self) -> None:
        self._done()


@dataclass
class Lease:
    engine: Engine
    release: Callable[[], None]

    def wrap(self, stream: AsyncIterator[StreamEvent]) -> AsyncIterator[StreamEvent]:
        return Leased(stream, self.release)


def _noop() -> None:
    return None


@dataclass
class _Resident:
    engine: Engine
    path: str


class ModelRegistry:
    def __init__(
        self,
        primary: Engine,
        builder: EngineBuilder | None = None,
        store: RecordStore | None = None,
        *,
        max_adapters: int = 0,
        max_lora_rank: int = 0,
    ) -> None:
        self.primary = primary
        self.builder = builder
        self.store = store
        self.max_adapters = max_adapters
        self.max_lora_rank = max_lora_rank
        # a remote primary forwards everything upstream (its adapters live there): no records
        self.durable = store is not None and primary.kind != "remote"
        self.base_name: str = str(getattr(primary, "name", "") or "")
        self.registered: dict[str, tuple[Engine, str]] = {}  # resident full models: (engine, path)
        self.resident: OrderedDict[str, _Resident] = OrderedDict()  # adapters, least recent first
        self.busy: dict[str, int] = {}  # adapter -> running requests
        self.loads = 0  # adapter loads done (first uses, publishes): tests count them
        self._pending: set[str] = set()  # names being published here right now
        self._adapter_lock = asyncio.Lock()
        self._model_lock = asyncio.Lock()

    # --- records -------------------------------------------------------------------------------
    async def _record(self, name: str) -> ModelRecord | None:
        if not self.durable or self.store is None:
            return None
        return await self.store.get(name)

    async def _records(self) -> list[ModelRecord]:
        if not self.durable or self.store is None:
            return []
        return await self.store.all()

    def capabilities(self) -> dict[str, Any]:
        kind = self.primary.kind
        adapters = kind in ("torch", "vllm", "llamacpp")
        rank: int | None = None
        if kind == "vllm":
            rank = getattr(self.primary, "max_lora_rank", None)
        elif adapters and self.max_lora_rank:
            rank = self.max_lora_rank
        return {
            "engine": kind,
            "adapters": adapters,
            "max_lora_rank": rank,
            "register_models": self.builder is not None,
            "forward_plan": plan.as_dict()
            if (plan := getattr(self.primary, "plan", None)) is not None
            else None,
        }

    # --- serving --------------------------------------------------------------------------------
    async def acquire(self, model: str, principal: Principal) -> Lease:
        """The engine for ``model`` as ``principal`` sees it, its weights loaded; release the
        lease when the request ends (an adapter with running requests is never evicted)."""
        if model == self.base_name and self.primary.kind != "remote":
            return Lease(self.primary, _noop)
        rec = await self._record(model)
        if rec is None or not rec.visible_to(principal):
            if rec is None:
                await self._forget(model)
                if not self.durable and self.primary.serves(model):
                    return Lease(self.primary, _noop)
            raise UnknownModel(f"The model `{model}` does not exist.")
        if rec.kind == "model":
            return Lease(await self._model_engine(rec), _noop)
        engine = await self._base_engine(rec)
        await self._ensure_adapter(rec, engine)  # counts the request as running

        def release() -> None:
            left = self.busy.get(rec.name, 0) - 1
            if left > 0:
                self.busy[rec.name] = left
            else:
                self.busy.pop(rec.name, None)

        return Lease(engine, release)

    async def _base_engine(self, rec: ModelRecord) -> Engine:
        if rec.base == self.base_name:
            return self.primary
        base = await self._record(rec.base)
        if base is None or base.kind != "model":
            raise UnknownModel(
                f"The model `{rec.name}` needs `{rec.base}`, which this server does not serve."
            )
        return await self._model_engine(base)

    async def _ensure_adapter(self, rec: ModelRecord, engine: Engine) -> None:
        hit = self.resident.get(rec.name)
        if hit is not None and hit.path == rec.path and hit.engine is engine:
            self.resident.move_to_end(rec.name)
            self.busy[rec.name] = self.busy.get(rec.name, 0) + 1
            return
        async with self._adapter_lock:
            # another request may have loaded it while this one waited: load once
            hit = self.resident.get(rec.name)
            if hit is None or hit.path != rec.path or hit.engine is not engine:
                await self._load_locked(rec, engine)
            self.resident.move_to_end(rec.name)
            self.busy[rec.name] = self.busy.get(rec.name, 0) + 1

    async def _load_locked(self, rec: ModelRecord, engine: Engine) -> None:
        """Load ``rec`` onto ``engine`` (caller holds the adapter lock), evicting to the cap."""
        stale = self.resident.pop(rec.name, None)
        if stale is not None:  # re-published under the same name with other weights
            await stale.engine.unload_adapter(rec.name)
        while self.max_adapters and len(self.resident) >= self.max_adapters:
            victim = next((n for n in self.resident if not self.busy.get(n)), None)
            if victim is None:
                # every resident adapter is running requests: go over the cap for now
                log.warning(
                    "all %d resident adapters are busy; loading %s over the cap", len(self.resident), rec.name
                )
                break
            gone = self.resident.pop(victim)
            log.info("evicting adapter %s (least recently used) to load %s", victim, rec.name)
            await gone.engine.unload_adapter(victim)
        await engine.load_adapter(rec.name, rec.path)
        self.loads += 1
        self.resident[rec.name] = _Resident(engine, rec.path)

    async def _model_engine(self, rec: ModelRecord) -> Engine:
        hit = self.registered.get(rec.name)
        if hit is not None and hit[1] == rec.path:
            return hit[0]
        async with self._model_lock:
            hit = self.registered.get(rec.name)
            if hit is not None and hit[1] == rec.path:
                return hit[0]
            if hit is not None:
                self.registered.pop(rec.name)
                await hit[0].shutdown()
            if self.builder is None:
                raise EngineUnavailable(
                    f"the {self.primary.kind} engine cannot serve registered models such as `{rec.name}`"
                )
            try:
                engine = await self.builder(rec.name, Path(rec.path))
                await engine.start()
            except (OSError, ValueError) as exc:
                raise EngineUnavailable(
                    f"the model `{rec.name}` could not be loaded from storage: {exc}"
                ) from None
            self.registered[rec.name] = (engine, rec.path)
            return engine

    async def _forget(self, name: str) -> None:
        """Drop local weights of a record deleted (through another replica)."""
        if name in self._pending:
            return
        if name in self.resident:
            async with self._adapter_lock:
                gone = self.resident.pop(name, None)
                if gone is not None:
                    await gone.engine.unload_adapter(name)
        if name in self.registered:
            async with self._model_lock:
                hit = self.registered.pop(name, None)
            if hit is not None:
                await hit[0].shutdown()

    async def models(self, principal: Principal) -> list[ServedModel]:
        served = await self.primary.models()
        if not self.durable:
            return served
        out = [m for m in served if m.kind == "base"]
        max_len = out[0].max_model_len if out else None
        records = await self._records()
        models = {r.name for r in records if r.kind == "model"}
        for rec in records:
            if not rec.visible_to(principal):
                continue
            if rec.kind == "model":
                hit = self.registered.get(rec.name)
                length = None
                if hit is not None:
                    length = next((c.max_model_len for c in await hit[0].models() if c.kind == "base"), None)
                out.append(
                    ServedModel(
                        rec.name, "registered", parent=rec.path, max_model_len=length, owned_by=rec.owner
                    )
                )
            elif rec.base == self.base_name or rec.base in models:
                out.append(
                    ServedModel(
                        rec.name, "adapter", parent=rec.base, max_model_len=max_len, owned_by=rec.owner
                    )
                )
        return out

    def engines(self) -> list[Engine]:
        return [self.primary, *(e for e, _ in self.registered.values())]

    # --- management -----------------------------------------------------------------------------
    async def _check_free(self, name: str) -> None:
        if name in RESERVED_NAMES:
            raise AdapterError(f"the name {name!r} is reserved")
        if name == self.base_name or await self._record(name) is not None:
            raise NameTaken(name)
        await self._forget(name)  # leftovers of a record deleted through another replica

    async def load_adapter(
        self, name: str, path: Path, tenant: str = "", base: str | None = None
    ) -> ModelRecord | None:
        """Record ``name`` durably and load it here (it is checked by loading)."""
        if not self.durable:
            await self.primary.load_adapter(name, str(path))
            return None
        assert self.store is not None
        await self._check_free(name)
        rank = adapter_rank(path)
        cap = self.capabilities()["max_lora_rank"]
        if cap is not None and rank is not None and rank > cap:
            raise AdapterError(
                f"lora_path {str(path)!r} has rank r={rank}, above this server's max_lora_rank {cap}"
            )
        base_name = base or self.base_name
        rec = ModelRecord(name, "adapter", tenant, str(path), base_name, rank, time.time())
        if base_name != self.base_name:
            base_rec = await self._record(base_name)
            if (
                base_rec is None
                or base_rec.kind != "model"
                or (base_rec.tenant and base_rec.tenant != tenant)
            ):
                raise UnknownModel(f"base {base_name!r}: no such registered model")
        engine = await self._base_engine(rec)
        self._pending.add(name)
        try:
            async with self._adapter_lock:
                await self._load_locked(rec, engine)
            if not await self.store.create(rec):  # another replica took the name meanwhile
                async with self._adapter_lock:
                    if self.resident.pop(name, None) is not None:
                        await engine.unload_adapter(name)
                raise NameTaken(name)
        finally:
            self._pending.discard(name)
        return rec

    async def register(self, name: str, path: Path, tenant: str = "") -> ModelRecord:
        if self.builder is None or self.store is None:
            raise AdapterError(f"the {self.primary.kind} engine cannot load further models")
        await self._check_free(name)
        rec = ModelRecord(name, "model", tenant, str(path), "", None, time.time())
        self._pending.add(name)
        try:
            await self._model_engine(rec)
            if not await self.store.create(rec):
                async with self._model_lock:
                    hit = self.registered.pop(name, None)
                if hit is not None:
                    await hit[0].shutdown()
                raise NameTaken(name)
        finally:
            self._pending.discard(name)
        return rec

    async def remove(self, name: str, principal: Principal, kind: str | None = None) -> ModelRecord | None:
        """Delete a fine-tune everywhere: its owner or an operator (others: it does not exist)."""
        if not self.durable or self.store is None:
            if kind == "adapter":
                await self.primary.unload_adapter(name)
                return None
            raise UnknownModel(f"The model `{name}` does not exist.")
        rec = await self.store.get(name)
        if (
            rec is None
            or not (principal.operator or rec.visible_to(principal))
            or (kind and rec.kind != kind)
        ):
            if kind == "adapter":
                raise AdapterNotFound(name, f"The adapter `{name}` does not exist.")
            what = "registered model" if kind == "model" else "model"
            raise UnknownModel(f"The {what} `{name}` does not exist.")
        if not principal.operator and rec.tenant != principal.tenant:
            raise NotPermitted(f"`{name}` is a shared model: only an operator key may remove it")
        await self.store.remove(name)
        await self._forget(name)
        return rec

    async def shutdown(self) -> None:
        for engine in self.engines():
            await engine.shutdown()
