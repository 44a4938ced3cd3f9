"""Evaluation sets and runs in Redis, per tenant (the agent's store, with its persistence).

Layout::

    tandem:agent:evals:<tenant>:sets            -> zset {set id: created_at}
    tandem:agent:evals:<tenant>:set:<id>        -> JSON EvalSet
    tandem:agent:evals:<tenant>:runs:<set id>   -> zset {run id: created_at}
    tandem:agent:evals:<tenant>:run:<id>        -> JSON EvalRun

Keys are per tenant, so another tenant's id is simply not there (a 404). Updates of a set read,
change and write it under WATCH, so two edits at once never lose one.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from services.agent.evals.protocol import EvalRun, EvalSet
from services.common.errors import NotFound

PREFIX = "tandem:agent:evals"


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(8)}"


class EvalStore:
    def __init__(self, client: aioredis.Redis) -> None:
        self.r = client

    def _k(self, tenant: str, *parts: str) -> str:
        return ":".join([PREFIX, tenant, *parts])

    # -- sets -----------------------------------------------------------------------------

    async def put_set(self, tenant: str, s: EvalSet) -> None:
        pipe = self.r.pipeline()
        pipe.set(self._k(tenant, "set", s.id), s.model_dump_json())
        pipe.zadd(self._k(tenant, "sets"), {s.id: s.created_at})
        await pipe.execute()

    async def get_set(self, tenant: str, set_id: str) -> EvalSet:
        raw = await self.r.get(self._k(tenant, "set", set_id))
        if raw is None:
            raise NotFound(f"no evaluation set {set_id!r}", param="set")
        return EvalSet.model_validate_json(raw)

    async def sets(self, tenant: str) -> list[EvalSet]:
        ids = [str(i) for i in await self.r.zrevrange(self._k(tenant, "sets"), 0, -1)]
        if not ids:
            return []
        raws = await self.r.mget([self._k(tenant, "set", i) for i in ids])
        return [EvalSet.model_validate_json(raw) for raw in raws if raw is not None]

    async def update_set(self, tenant: str, set_id: str, change: Callable[[EvalSet], EvalSet]) -> EvalSet:
        """``change`` applied to the stored set and written back, retried if another write came
        in between (``change`` may raise to refuse)."""
        key = self._k(tenant, "set", set_id)
        async with self.r.pipeline() as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None:
                        raise NotFound(f"no evaluation set {set_id!r}", param="set")
                    updated = change(EvalSet.model_validate_json(raw))
                    pipe.multi()
                    pipe.set(key, updated.model_dump_json())
                    await pipe.execute()
                    return updated
                except WatchError:
                    continue

    async def delete_set(self, tenant: str, set_id: str) -> None:
        """The set and its runs."""
        await self.get_set(tenant, set_id)
        run_ids = [str(i) for i in await self.r.zrange(self._k(tenant, "runs", set_id), 0, -1)]
        pipe = self.r.pipeline()
        pipe.delete(self._k(tenant, "set", set_id), self._k(tenant, "runs", set_id))
        pipe.zrem(self._k(tenant, "sets"), set_id)
        for run_id in run_ids:
            pipe.delete(self._k(tenant, "run", run_id))
        await pipe.execute()

    # -- runs -----------------------------------------------------------------------------

    async def put_run(self, tenant: str, run: EvalRun, keep: int | None = None) -> None:
        """Writes ``run``; with ``keep``, only the newest ``keep`` runs of its set stay."""
        index = self._k(tenant, "runs", run.set)
        pipe = self.r.pipeline()
        pipe.set(self._k(tenant, "run", run.id), run.model_dump_json())
        pipe.zadd(index, {run.id: run.created_at})
        await pipe.execute()
        if keep is not None:
            old = [str(i) for i in await self.r.zrange(index, 0, -keep - 1)]
            if old:
                pipe = self.r.pipeline()
                pipe.zrem(index, *old)
                pipe.delete(*[self._k(tenant, "run", i) for i in old])
                await pipe.execute()

    async def get_run(self, tenant: str, run_id: str) -> EvalRun:
        raw = await self.r.get(self._k(tenant, "run", run_id))
        if raw is None:
            raise NotFound(f"no evaluation run {run_id!r}", param="run")
        return EvalRun.model_validate_json(raw)

    async def runs(self, tenant: str, set_ids: list[str], limit: int) -> list[EvalRun]:
        """The newest ``limit`` runs of the sets, newest first."""
        found: list[tuple[float, str]] = []
        for set_id in set_ids:
            got: list[Any] = await self.r.zrevrange(
                self._k(tenant, "runs", set_id), 0, limit - 1, withscores=True
            )
            found += [(float(score), str(rid)) for rid, score in got]
        found.sort(reverse=True)
        ids = [rid for _, rid in found[:limit]]
        if not ids:
            return []
        raws = await self.r.mget([self._k(tenant, "run", i) for i in ids])
        return [EvalRun.model_validate_json(raw) for raw in raws if raw is not None]
