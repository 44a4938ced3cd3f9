"""Stored responses of the Responses API, in Redis, per service and tenant, with a TTL.

Layout (the tenant is part of the key, so one tenant can never name another's)::

    tandem:responses:<service>:<tenant>:<resp id>  JSON {"response": {...}, "messages": [...]}

``messages`` is the conversation up to and with the response, as chat messages (the input of
every response it continues from, then its own output): what ``previous_response_id`` puts
before a new request's input. ``instructions`` are not part of it (OpenAI's way: each request
gives its own).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from services.common.errors import NotFound
from services.common.responses_wire import (
    RESPONSE_ID_PATTERN,
    FunctionCallItem,
    OutputMessage,
    ResponseObject,
)

TTL_S = 30 * 24 * 3600
_ID_RE = re.compile(RESPONSE_ID_PATTERN)


@dataclass
class Stored:
    response: dict[str, Any]
    messages: list[dict[str, Any]]


def output_messages(response: ResponseObject) -> list[dict[str, Any]]:
    """The response's output as chat messages: its text, and the calls it made."""
    text = "".join(
        p.text for item in response.output if isinstance(item, OutputMessage) for p in item.content
    )
    calls = [
        {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        for item in response.output
        if isinstance(item, FunctionCallItem)
    ]
    if not text and not calls:
        return []
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


class ResponseStore:
    def __init__(self, client: aioredis.Redis, service: str, ttl_s: int = TTL_S) -> None:
        self.r, self.service, self.ttl_s = client, service, ttl_s

    def _key(self, tenant: str, response_id: str) -> str:
        return f"tandem:responses:{self.service}:{tenant}:{response_id}"

    async def save(self, tenant: str, response: ResponseObject, inputs: list[dict[str, Any]]) -> None:
        """Keep ``response`` with the conversation it ends (``inputs``: what came before its output)."""
        record = {
            "response": response.model_dump(mode="json"),
            "messages": [*inputs, *output_messages(response)],
        }
        await self.r.set(self._key(tenant, response.id), json.dumps(record), ex=self.ttl_s)

    async def load(self, tenant: str, response_id: str, param: str = "response_id") -> Stored:
        """The stored response, or a 404 naming ``param`` (also for another tenant's id)."""
        raw = await self.r.get(self._key(tenant, response_id)) if _ID_RE.match(response_id) else None
        if raw is None:
            raise NotFound(f"no response {response_id!r}", param=param, code="response_not_found")
        record = json.loads(raw)
        return Stored(record["response"], record["messages"])

    async def delete(self, tenant: str, response_id: str) -> None:
        removed = await self.r.delete(self._key(tenant, response_id)) if _ID_RE.match(response_id) else 0
        if not removed:
            raise NotFound(f"no response {response_id!r}", param="response_id", code="response_not_found")
