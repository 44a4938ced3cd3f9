"""The audit log: an append-only record, per tenant, of who did what.

Every service appends to it (one Redis stream per tenant, ``tandem:audit:<tenant>``); a tenant's
admins read it on the agent (``GET /v1/audit``, filtered by actor, action and time, or exported
as JSON lines). Nothing rewrites or deletes an entry: only retention drops the oldest ones
(``TANDEM_AUDIT_RETENTION_DAYS`` and ``TANDEM_AUDIT_MAX_ENTRIES``).

An entry's stream id starts with its time in milliseconds, so a time filter is a range read,
not a scan; should the clock step back, the entry takes the next id after the last one and
keeps its own ``at``.

The actions recorded:

- ``key.create``, ``key.revoke`` (``tandem keys``), ``user.create``, ``user.update``,
  ``user.delete``, ``token.create``, ``token.revoke`` (``/v1/users`` on the agent);
- ``user.sign_in``, ``user.sign_out`` (the web sign-in with the OpenID provider, by the user;
  a user made at its first sign-in also gets ``user.create`` by itself, ``"via": "oidc"``);
- ``model.promote``, ``model.rollback``, ``model.allow``, ``model.disallow`` (a fine-tune from
  feedback served to everyone whatever its collections, or no longer), ``mcp_server.register``,
  ``mcp_server.update``, ``mcp_server.remove``, ``training.start`` (``POST /v1/feedback/train``)
  on the agent;
- ``training.job`` (``POST /v1/jobs`` on the trainer);
- ``document.upload``, ``document.delete``, ``source.add``, ``source.delete``, ``source.sync`` (on
  demand), ``collection.access`` (an access list set or removed: the lists before and after) on
  retrieval.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

import redis
import redis.asyncio as aioredis
from anyio import from_thread
from pydantic import BaseModel, Field
from starlette.requests import HTTPConnection

from services.common.auth import Principal
from services.common.config import CommonSettings
from services.common.errors import Unauthorized
from services.common.jsonsafe import JsonObject

DAY_S = 86_400.0
BATCH = 500
ActorKind = Literal["user", "key", "cli"]


class Actor(BaseModel):
    kind: ActorKind = Field(description="user (a person's token), key (a tenant or operator key) or cli")
    id: str = Field(description="the user's id, the key's id, or the operating-system account of the cli")


class AuditEntry(BaseModel):
    id: str = Field(description="the entry's id in the log (its time in milliseconds, a sequence number)")
    at: float = Field(description="unix seconds")
    tenant: str
    actor: Actor
    action: str
    target: str = ""
    detail: JsonObject = Field(default_factory=dict)


@dataclass(frozen=True)
class AuditFilter:
    actor: str | None = None
    action: str | None = None
    since: float | None = None  # unix seconds, inclusive
    until: float | None = None  # unix seconds, inclusive

    def matches(self, entry: AuditEntry) -> bool:
        return (
            (self.actor is None or entry.actor.id == self.actor)
            and (self.action is None or entry.action == self.action)
            and (self.since is None or entry.at >= self.since)
            and (self.until is None or entry.at <= self.until)
        )


def actor_of(principal: Principal) -> Actor:
    return Actor(kind="user" if principal.user_id else "key", id=principal.key_id)


def stream_key(tenant: str) -> str:
    return f"tandem:audit:{tenant}"


def _ms(seconds: float) -> int:
    return max(0, int(seconds * 1000))


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


MAX_ID_PART = 2**64 - 1


def id_before(entry_id: str) -> str | None:
    """The last stream id before ``entry_id`` (``<ms>-<seq>``, each part below 2**64); None
    before ``0-0``. ValueError for anything else."""
    ms_text, _, seq_text = entry_id.partition("-")
    ms, seq = int(ms_text), int(seq_text)
    if not (0 <= ms <= MAX_ID_PART and 0 <= seq <= MAX_ID_PART):
        raise ValueError(f"{entry_id!r} is not an audit entry id")
    if seq:
        return f"{ms}-{seq - 1}"
    return f"{ms - 1}-{MAX_ID_PART}" if ms else None


def _entry(tenant: str, entry_id: object, raw: dict[Any, Any]) -> AuditEntry:
    data = {_text(k): _text(v) for k, v in raw.items()}
    return AuditEntry(
        id=_text(entry_id),
        at=float(data["at"]),
        tenant=tenant,
        actor=Actor.model_validate({"kind": data["actor_kind"], "id": data["actor_id"]}),
        action=data["action"],
        target=data.get("target", ""),
        detail=json.loads(data.get("detail") or "{}"),
    )


class AuditLog:
    """Appends to and reads the tenants' audit logs. ``clock`` is settable (tests)."""

    def __init__(
        self,
        client: aioredis.Redis,
        retention_days: int = 365,
        max_entries: int = 1_000_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.r = client
        self.retention_s = retention_days * DAY_S
        self.max_entries = max_entries
        self.clock = clock

    @classmethod
    def from_settings(cls, client: aioredis.Redis, common: CommonSettings) -> AuditLog:
        return cls(client, common.audit_retention_days, common.audit_max_entries)

    async def record(
        self, tenant: str, actor: Actor, action: str, target: str = "", detail: JsonObject | None = None
    ) -> AuditEntry:
        at = self.clock()
        fields: dict[Any, Any] = {
            "at": repr(at),
            "actor_kind": actor.kind,
            "actor_id": actor.id,
            "action": action,
            "target": target,
            "detail": json.dumps(detail or {}, sort_keys=True),
        }
        key = stream_key(tenant)
        try:
            entry_id = await self.r.xadd(
                key, fields, id=f"{max(1, _ms(at))}-*", maxlen=self.max_entries, approximate=False
            )
        except redis.ResponseError:  # the clock is behind the log's last entry
            entry_id = await self.r.xadd(key, fields, maxlen=self.max_entries, approximate=False)
        # exact trimming: it removes only the entries past retention, usually none or one
        await self.r.xtrim(key, minid=str(_ms(at - self.retention_s)), approximate=False)
        return _entry(tenant, entry_id, fields)

    async def entries(
        self, tenant: str, filt: AuditFilter, limit: int = 100, before: str | None = None
    ) -> tuple[list[AuditEntry], bool]:
        """Matching entries, newest first, older than the entry ``before`` when given; and
        whether more match."""
        hi = str(_ms(filt.until) + 1) if filt.until is not None else "+"
        if before:
            older = id_before(before)
            if older is None:  # nothing is older than the first possible id
                return [], False
            hi = older
        lo = str(_ms(filt.since)) if filt.since is not None else "-"
        out: list[AuditEntry] = []
        while True:
            batch: list[Any] = await self.r.xrevrange(stream_key(tenant), max=hi, min=lo, count=BATCH) or []
            for entry_id, raw in batch:
                entry = _entry(tenant, entry_id, raw)
                if filt.matches(entry):
                    if len(out) == limit:
                        return out, True
                    out.append(entry)
            if len(batch) < BATCH:
                return out, False
            hi = f"({_text(batch[-1][0])}"

    async def export(self, tenant: str, filt: AuditFilter) -> AsyncIterator[AuditEntry]:
        """Every matching entry, oldest first, read a batch at a time."""
        lo = str(_ms(filt.since)) if filt.since is not None else "-"
        hi = str(_ms(filt.until) + 1) if filt.until is not None else "+"
        while True:
            batch: list[Any] = await self.r.xrange(stream_key(tenant), min=lo, max=hi, count=BATCH) or []
            for entry_id, raw in batch:
                entry = _entry(tenant, entry_id, raw)
                if filt.matches(entry):
                    yield entry
            if len(batch) < BATCH:
                return
            lo = f"({_text(batch[-1][0])}"


async def audit_request(
    conn: HTTPConnection, action: str, target: str = "", detail: JsonObject | None = None
) -> None:
    """Records ``action`` by the request's caller in its tenant's log (one line in a route)."""
    principal = conn.scope.get("state", {}).get("principal")
    if not isinstance(principal, Principal):
        raise Unauthorized("not authenticated")
    log: AuditLog = conn.app.state.audit
    await log.record(principal.tenant, actor_of(principal), action, target, detail)


def audit_from_thread(
    conn: HTTPConnection, action: str, target: str = "", detail: JsonObject | None = None
) -> None:
    """``audit_request`` from a synchronous route (run in a worker thread of the event loop)."""
    from_thread.run(audit_request, conn, action, target, detail)
