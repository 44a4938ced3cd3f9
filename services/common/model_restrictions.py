"""Which of a tenant's fine-tunes from feedback a caller may be served.

A fine-tune trained on feedback may have learnt the contents of the collections its rows'
answers came from, so it answers a caller only if that caller may read every one of them (by the
collections' access lists, services/common/access.py), unless an admin allowed it for the whole
tenant (the agent's ``POST /v1/models/{id}/allow``). Admins (admin keys and users, and an operator
key acting for the tenant) read every collection, so nothing is withheld from them.

The agent records the facts when a training round from feedback starts (the collections) and
when an admin allows or disallows the model (services/agent/model_choice.py); the agent, choosing
a tenant's model for a turn, and the inference service, serving a model a caller named, both
decide here. Redis layout (one hash per tenant)::

    tandem:model-collections:<tenant> -> hash {model name: JSON {"collections", "allowed"}}

A refusal names no collection: a collection the caller may not read is, to it, one that does not
exist.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis.asyncio as aioredis
from pydantic import BaseModel

from services.common.access import AccessStore, may_read
from services.common.auth import Principal
from services.common.errors import Forbidden


class ModelRestriction(BaseModel):
    collections: list[str]
    allowed: bool = False


class ModelRestrictions:
    """The tenants' fine-tunes from feedback, with the collections each was trained on."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.r = client

    @staticmethod
    def key(tenant: str) -> str:
        return f"tandem:model-collections:{tenant}"

    async def get(self, tenant: str, model: str) -> ModelRestriction | None:
        raw = await self.r.hget(self.key(tenant), model)
        return ModelRestriction.model_validate_json(raw) if raw is not None else None

    async def put(self, tenant: str, models: Iterable[str], collections: list[str], allowed: bool) -> None:
        """Records what ``models`` (the names one training job's model goes by) were trained on; a
        model trained on no collection is restricted by none, so its record goes."""
        names = sorted({m for m in models if m})
        if not names:
            return
        if not collections:
            await self.r.hdel(self.key(tenant), *names)
            return
        record = ModelRestriction(collections=sorted(set(collections)), allowed=allowed).model_dump_json()
        await self.r.hset(self.key(tenant), mapping=dict.fromkeys(names, record))

    async def withheld(self, principal: Principal, model: str | None) -> bool:
        """Whether ``model`` (None or '': the base model) is withheld from ``principal``."""
        if not model or principal.is_admin:
            return False
        found = await self.get(principal.tenant, model)
        if found is None or not found.collections or found.allowed:
            return False
        lists = await AccessStore(self.r).all(principal.tenant)
        return not all(may_read(principal, lists.get(name)) for name in found.collections)

    async def check_named(self, principal: Principal, model: str, param: str) -> None:
        """A 403 saying why, when ``principal`` named a model withheld from it."""
        if await self.withheld(principal, model):
            raise withheld_error(model, param)


def withheld_error(model: str, param: str) -> Forbidden:
    return Forbidden(
        f"{param}: model {model!r} was fine-tuned on feedback about collections this caller may not "
        "read; use another model, or ask an admin to allow it for everyone "
        f"(POST /v1/models/{model}/allow on the agent)",
        param=param,
        code="model_withheld",
    )


__all__ = ["ModelRestriction", "ModelRestrictions", "withheld_error"]
