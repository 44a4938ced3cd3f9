"""Stored responses of the Responses API, in Redis, per service and tenant, with a TTL.

Layout (the tenant is part of the key, so one tenant can never name another's)::

    tandem:responses:<service>:<tenant>:<resp id>  JSON {"response": {...}, "messages": [...]}

``messages`` is the conversation up to and with the response, as chat messages (the input of
every response it continues from, then its own output): what ``previous_response_id`` puts
before a new request's input. ``instructions`` are not part of it (OpenAI's way: each request
gives its own).

A response saved with an ``owner`` (the key or user that asked: ``Principal.owner``) is that
owner's, like a conversation: another member of the tenant reading, continuing or deleting it
gets the 404 of a missing one (it may hold what only its owner may read, such as passages of a
collection with an access list); the tenant's admins see all. One saved without is the tenant's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

import redis.asyncio as aioredis

from services.common.auth import Principal
from services.common.chat_messages import ChatMessage, MessageCall
from services.common.errors import NotFound
from services.common.responses_wire import (
    RESPONSE_ID_PATTERN,
    FunctionCallItem,
    OutputMessage,
    ResponseObject,
)

TTL_S = 30 * 24 * 3600
_ID_RE = re.compile(RESPONSE_ID_PATTERN)


class StoredRecord(TypedDict):
    """The JSON kept under a response's key."""

    response: dict[str, Any]  # ResponseObject's JSON, returned as stored
    messages: list[ChatMessage]
    owner: NotRequired[str]


@dataclass
class Stored:
    response: dict[str, Any]
    messages: list[ChatMessage]


def output_messages(response: ResponseObject) -> list[ChatMessage]:
    """The response's output as chat messages: its text, and the calls it made."""
    text = "".join(
        p.text for item in response.output if isinstance(item, OutputMessage) for p in item.content
    )
    calls: list[MessageCall] = [
        {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        for item in response.output
        if isinstance(item, FunctionCallItem)
    ]
    if not text and not calls:
        return []
    message: ChatMessage = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


class ResponseStore:
    def __init__(self, client: aioredis.Redis, service: str, ttl_s: int = TTL_S) -> None:
        self.r, self.service, self.ttl_s = client, service, ttl_s

    def _key(self, tenant: str, response_id: str) -> str:
        return f"tandem:responses:{self.service}:{tenant}:{response_id}"

    async def save(
        self, tenant: str, response: ResponseObject, inputs: list[ChatMessage], owner: str | None = None
    ) -> None:
        """Keep ``response`` with the conversation it ends (``inputs``: what came before its output),
        as ``owner``'s when given."""
        record: StoredRecord = {
            "response": response.model_dump(mode="json"),
            "messages": [*inputs, *output_messages(response)],
        }
        if owner is not None:
            record["owner"] = owner
        await self.r.set(self._key(tenant, response.id), json.dumps(record), ex=self.ttl_s)

    async def load(
        self, tenant: str, response_id: str, param: str = "response_id", reader: Principal | None = None
    ) -> Stored:
        """The stored response, or a 404 naming ``param`` (also for another tenant's id, and for
        another owner's when ``reader`` is given and no admin)."""
        raw = await self.r.get(self._key(tenant, response_id)) if _ID_RE.match(response_id) else None
        record: StoredRecord | None = json.loads(raw) if raw is not None else None
        if record is None or not _readable(record, reader):
            raise NotFound(f"no response {response_id!r}", param=param, code="response_not_found")
        return Stored(record["response"], record["messages"])

    async def delete(self, tenant: str, response_id: str, reader: Principal | None = None) -> None:
        if reader is not None:
            await self.load(tenant, response_id, reader=reader)  # another owner's: a 404
        removed = await self.r.delete(self._key(tenant, response_id)) if _ID_RE.match(response_id) else 0
        if not removed:
            raise NotFound(f"no response {response_id!r}", param="response_id", code="response_not_found")


def _readable(record: StoredRecord, reader: Principal | None) -> bool:
    owner = record.get("owner")
    return reader is None or owner is None or reader.is_admin or owner == reader.owner
