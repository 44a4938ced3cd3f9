"""Tool calls held for a person's decision (an agent with ``side_effects: approve``), in Redis.

A run that stops at a side-effecting call leaves an ``Approval``: the turn as it was asked (agent,
message, conversation, the history the run saw, the model), the call and its arguments, and what
earlier decisions of the same turn allowed. ``decide`` takes one decision, once: the run is then
asked again with that exact call allowed or refused (services/agent/runtime.py ``resume``).

Layout (the tenant is part of every key; the owner is checked on every read)::

    tandem:agent:approval:<tenant>:<id>      hash  {owner, record (JSON), decision, decided_at}
    tandem:agent:approvals:<tenant>:<owner>  zset  id -> expires_at (the owner's pending ones)

Expiry is read from the record against an injectable clock (``clock``); the Redis TTL only tidies
up, a day after the approval could no longer be used, so a late decision is still told it expired.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from services.agent.protocol import Message
from services.common.errors import Conflict, Gone, NotFound

ID_RE = re.compile(r"^apr_[0-9a-f]{24}$")
# How long an expired approval is kept to answer 410 (rather than 404) to a late decision.
KEEP_EXPIRED_S = 24 * 3600
Decision = Literal["approved", "denied"]


class PerformedCall(BaseModel):
    """An approved call an earlier run of the turn already made, and what it answered."""

    call: str
    text: str
    ok: bool


class PendingApproval(BaseModel):
    """A held call as GET /v1/agents/approvals lists it."""

    approval_id: str
    created_at: float
    expires_at: float
    agent: str
    message: str
    conversation_id: str | None = None
    tool: str
    arguments: Any = None


class ApprovalList(BaseModel):
    data: list[PendingApproval]


class Approval(BaseModel):
    approval_id: str
    owner: str
    created_at: float
    expires_at: float
    # the turn, as it is asked again
    agent: str
    message: str
    collection: str | None = None
    conversation_id: str | None = None
    remember: bool = False
    llm: str | None = None
    mcp_servers: list[str] = Field(default_factory=list)
    history: list[dict[str, Any]] = Field(default_factory=list)
    # the held call
    tool: str
    arguments: Any = None
    call: str
    # earlier decisions of the same turn, which the next run keeps
    approved: list[str] = Field(default_factory=list)
    denied: list[str] = Field(default_factory=list)
    performed: list[PerformedCall] = Field(default_factory=list)
    decision: Decision | None = None
    decided_at: float | None = None

    def messages(self) -> list[Message]:
        return [Message.model_validate(m) for m in self.history]

    def public(self) -> PendingApproval:
        """What GET /v1/agents/approvals lists."""
        return PendingApproval.model_validate(self.model_dump(include=set(PendingApproval.model_fields)))


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class ApprovalStore:
    def __init__(self, client: aioredis.Redis, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self.r = client
        self.ttl_s = ttl_s
        self.clock = clock

    @staticmethod
    def _key(tenant: str, approval_id: str) -> str:
        return f"tandem:agent:approval:{tenant}:{approval_id}"

    @staticmethod
    def _index(tenant: str, owner: str) -> str:
        return f"tandem:agent:approvals:{tenant}:{owner}"

    async def hold(self, tenant: str, approval: Approval) -> Approval:
        """Keeps ``approval`` (its ``created_at``/``expires_at`` set here, from the clock)."""
        now = self.clock()
        approval.created_at, approval.expires_at = now, now + self.ttl_s
        key = self._key(tenant, approval.approval_id)
        pipe = self.r.pipeline()
        pipe.hset(key, mapping={"owner": approval.owner, "record": approval.model_dump_json()})
        pipe.expire(key, int(self.ttl_s) + KEEP_EXPIRED_S)
        index = self._index(tenant, approval.owner)
        pipe.zadd(index, {approval.approval_id: approval.expires_at})
        pipe.expire(index, int(self.ttl_s) + KEEP_EXPIRED_S)
        await pipe.execute()
        return approval

    async def get(self, tenant: str, owner: str, approval_id: str) -> Approval:
        """The owner's approval, or NotFound (also for another tenant's or another key's)."""
        data: dict[str, str] = {}
        if ID_RE.match(approval_id):
            data = dict(await self.r.hgetall(self._key(tenant, approval_id)))  # type: ignore[arg-type]
        if not data or data.get("owner") != owner:
            raise NotFound(f"no approval {approval_id!r}", param="approval_id")
        approval = Approval.model_validate_json(data["record"])
        if data.get("decision") in ("approved", "denied"):
            approval.decision = data["decision"]  # type: ignore[assignment]
            approval.decided_at = float(data.get("decided_at") or 0)
        return approval

    async def decide(self, tenant: str, owner: str, approval_id: str, approve: bool) -> Approval:
        """Records the one decision an approval takes: a second is a 409, one after it expired a
        410 naming when."""
        approval = await self.get(tenant, owner, approval_id)
        if approval.decision is not None:
            raise self._decided(approval)
        now = self.clock()
        if now >= approval.expires_at:
            raise Gone(
                f"approval {approval_id!r} expired at {_when(approval.expires_at)} "
                f"({self.ttl_s:g} s after the call was held); ask the agent again",
                param="approval_id",
                code="approval_expired",
            )
        decision: Decision = "approved" if approve else "denied"
        key = self._key(tenant, approval_id)
        # HSETNX: of two decisions racing, exactly one is recorded
        if not await self.r.hsetnx(key, "decision", decision):  # type: ignore[misc]
            raise self._decided(await self.get(tenant, owner, approval_id))
        await self.r.hset(key, "decided_at", str(now))  # type: ignore[misc]
        await self.r.zrem(self._index(tenant, owner), approval_id)
        approval.decision, approval.decided_at = decision, now
        return approval

    @staticmethod
    def _decided(approval: Approval) -> Conflict:
        at = f" at {_when(approval.decided_at)}" if approval.decided_at else ""
        return Conflict(
            f"approval {approval.approval_id!r} was already {approval.decision}{at}",
            param="approval_id",
            code="approval_decided",
        )

    async def pending(self, tenant: str, owner: str) -> list[Approval]:
        """The owner's approvals still waiting for a decision, oldest first."""
        index = self._index(tenant, owner)
        now = self.clock()
        out: list[Approval] = []
        for raw in await self.r.zrange(index, 0, -1):
            approval_id = str(raw)
            try:
                approval = await self.get(tenant, owner, approval_id)
            except NotFound:
                await self.r.zrem(index, approval_id)  # tidied away by its TTL
                continue
            if approval.decision is None and now < approval.expires_at:
                out.append(approval)
        return out
