"""Conversation memory in Redis, per tenant and user, with a TTL and size caps.

Layout (the tenant is part of every key, so one tenant can never name another's)::

    tandem:agent:conv:<tenant>:<id>            hash  {user, title, pipeline, collection, llm, created_at, updated_at}
    tandem:agent:conv:<tenant>:<id>:messages   list  of JSON {role, content, citations?, message_id?, ts}
    tandem:agent:convs:<tenant>:<user>         zset  id -> updated_at (the user's conversations)

Every write refreshes the TTL of the keys it touches; a conversation keeps its
newest ``max_messages`` messages, a user their ``max_conversations`` most recently
used conversations (older ones are deleted).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from pydantic import BaseModel

from services.agent.protocol import Message
from services.common.errors import NotFound

ID_RE = re.compile(r"^conv_[0-9a-f]{24}$")


class ConversationSummary(BaseModel):
    """A conversation as listed: ``llm`` is the model its later turns generate with (None: the default)."""

    id: str
    title: str
    pipeline: str
    collection: str
    llm: str | None
    created_at: float
    updated_at: float


class Conversation(ConversationSummary):
    """A conversation with its messages, as kept (role, content, ``ts``; an answer's
    ``message_id``, citations and steps)."""

    messages: list[dict[str, Any]]


@dataclass
class MemoryLimits:
    ttl_s: int = 7 * 24 * 3600
    max_messages: int = 100
    max_conversations: int = 200
    max_chars: int = 32_000


class ConversationStore:
    def __init__(self, client: aioredis.Redis, limits: MemoryLimits | None = None) -> None:
        self.r = client
        self.limits = limits or MemoryLimits()

    @staticmethod
    def _key(tenant: str, conv_id: str) -> str:
        return f"tandem:agent:conv:{tenant}:{conv_id}"

    @staticmethod
    def _index(tenant: str, user: str) -> str:
        return f"tandem:agent:convs:{tenant}:{user}"

    async def create(
        self,
        tenant: str,
        user: str,
        *,
        title: str = "",
        pipeline: str = "",
        collection: str = "",
        llm: str = "",
    ) -> str:
        conv_id = f"conv_{secrets.token_hex(12)}"
        now = time.time()
        key = self._key(tenant, conv_id)
        pipe = self.r.pipeline()
        pipe.hset(
            key,
            mapping={
                "user": user,
                "title": title[:120],
                "pipeline": pipeline,
                "collection": collection,
                "llm": llm,
                "created_at": str(now),
                "updated_at": str(now),
            },
        )
        pipe.expire(key, self.limits.ttl_s)
        pipe.zadd(self._index(tenant, user), {conv_id: now})
        pipe.expire(self._index(tenant, user), self.limits.ttl_s)
        await pipe.execute()
        await self._evict(tenant, user)
        return conv_id

    async def _evict(self, tenant: str, user: str) -> None:
        index = self._index(tenant, user)
        extra = await self.r.zcard(index) - self.limits.max_conversations
        if extra > 0:
            oldest = await self.r.zrange(index, 0, extra - 1)
            for conv_id in oldest:
                await self._delete_keys(tenant, user, str(conv_id))

    async def _delete_keys(self, tenant: str, user: str, conv_id: str) -> None:
        key = self._key(tenant, conv_id)
        await self.r.delete(key, f"{key}:messages")
        await self.r.zrem(self._index(tenant, user), conv_id)

    async def meta(self, tenant: str, user: str, conv_id: str) -> dict[str, str]:
        """The conversation's metadata, or NotFound (also for another tenant's or user's id)."""
        data: dict[str, str] = {}
        if ID_RE.match(conv_id):
            data = dict(await self.r.hgetall(self._key(tenant, conv_id)))  # type: ignore[arg-type]
        if not data or data.get("user") != user:
            raise NotFound(f"no conversation {conv_id!r}", param="conversation_id")
        return data

    async def owner(self, tenant: str, conv_id: str) -> str | None:
        """Whose conversation this is (None: the tenant has no such conversation)."""
        if not ID_RE.match(conv_id):
            return None
        user = await self.r.hget(self._key(tenant, conv_id), "user")  # type: ignore[misc]
        return None if user is None else str(user)

    async def append(self, tenant: str, user: str, conv_id: str, messages: list[dict[str, Any]]) -> None:
        await self.meta(tenant, user, conv_id)
        key = self._key(tenant, conv_id)
        now = time.time()
        encoded = []
        for msg in messages:
            item = dict(msg)
            item["content"] = str(item.get("content", ""))[: self.limits.max_chars]
            item.setdefault("ts", now)
            encoded.append(json.dumps(item))
        pipe = self.r.pipeline()
        pipe.rpush(f"{key}:messages", *encoded)
        pipe.ltrim(f"{key}:messages", -self.limits.max_messages, -1)
        pipe.hset(key, "updated_at", str(now))
        for k in (key, f"{key}:messages", self._index(tenant, user)):
            pipe.expire(k, self.limits.ttl_s)
        pipe.zadd(self._index(tenant, user), {conv_id: now})
        await pipe.execute()

    async def messages(self, tenant: str, user: str, conv_id: str) -> list[dict[str, Any]]:
        await self.meta(tenant, user, conv_id)
        raw = await self.r.lrange(f"{self._key(tenant, conv_id)}:messages", 0, -1)
        return [json.loads(m) for m in raw]

    async def history(self, tenant: str, user: str, conv_id: str) -> list[Message]:
        """Role and content only: what goes back into prompts."""
        return [
            Message(role=m["role"], content=m["content"]) for m in await self.messages(tenant, user, conv_id)
        ]

    async def list(self, tenant: str, user: str, limit: int = 100) -> list[ConversationSummary]:
        index = self._index(tenant, user)
        ids = await self.r.zrevrange(index, 0, limit - 1)
        out = []
        for raw_id in ids:
            conv_id = str(raw_id)
            data: dict[str, str] = dict(await self.r.hgetall(self._key(tenant, conv_id)))  # type: ignore[arg-type]
            if not data:  # expired: tidy the index
                await self.r.zrem(index, conv_id)
                continue
            out.append(self._public(conv_id, data))
        return out

    async def get(self, tenant: str, user: str, conv_id: str) -> Conversation:
        data = await self.meta(tenant, user, conv_id)
        summary = self._public(conv_id, data)
        return Conversation(**summary.model_dump(), messages=await self.messages(tenant, user, conv_id))

    async def rename(self, tenant: str, user: str, conv_id: str, title: str) -> ConversationSummary:
        await self.meta(tenant, user, conv_id)
        await self.r.hset(self._key(tenant, conv_id), "title", title[:120])
        return self._public(conv_id, await self.meta(tenant, user, conv_id))

    async def set_llm(self, tenant: str, user: str, conv_id: str, llm: str) -> None:
        """Later turns of the conversation generate with ``llm`` unless they name another."""
        await self.meta(tenant, user, conv_id)
        await self.r.hset(self._key(tenant, conv_id), "llm", llm)

    async def delete(self, tenant: str, user: str, conv_id: str) -> None:
        await self.meta(tenant, user, conv_id)
        await self._delete_keys(tenant, user, conv_id)

    @staticmethod
    def _public(conv_id: str, data: dict[str, str]) -> ConversationSummary:
        return ConversationSummary(
            id=conv_id,
            title=data.get("title", ""),
            pipeline=data.get("pipeline", ""),
            collection=data.get("collection", ""),
            llm=data.get("llm") or None,
            created_at=float(data.get("created_at", 0)),
            updated_at=float(data.get("updated_at", 0)),
        )
