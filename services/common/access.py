"""Who may read and who may write a collection: its access list.

A collection without a list is open to its whole tenant: every key and user of the tenant reads
it, and every one that may write at all (not a viewer) writes it. A list names its readers and
its writers, each entry one of

- ``user:<id>``: a person (services/common/users.py);
- ``group:<name>``: everyone whose groups hold that name (from the identity provider, or set by
  an admin on the user);
- ``key:<id>``: a tenant API key (a service account).

Writers read too. A tenant's admins (admin keys, admin users, and an operator key acting for the
tenant) read and write every collection, listed or not; a viewer never writes, whatever the list
says. Retrieval enforces the lists on every route that touches a collection, and every other
surface (the agent's pipelines, streams, tools, MCP server, OpenAI facade and Responses API)
calls retrieval with the caller's own credential, so it sees what the caller may read and no more.

Redis layout (one hash per tenant, so listing a tenant's collections reads it once)::

    tandem:access:<tenant> -> hash {collection name: JSON {"readers", "writers", "updated_at"}}
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Annotated, Any

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field

from services.common.auth import Principal
from services.common.errors import InvalidRequest, NotFound
from services.common.users import GROUP_RE, UserStore

# Entries one list may hold: enough for a department's named people and groups; more is a
# sign that a group is the better tool.
MAX_ENTRIES = 256
# "group:" and a 64-character group name, with room to spare.
ENTRY_CHARS = 80
KINDS = ("user", "group", "key")
# User ids are ``u_`` and hex, key ids hex (services/common/users.py, auth.py).
ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

Entry = Annotated[str, Field(max_length=ENTRY_CHARS, description="user:<id>, group:<name> or key:<id>")]


class AccessList(BaseModel):
    """``PUT /v1/collections/{name}/access``: who may read and who may write the collection."""

    model_config = ConfigDict(extra="forbid")
    readers: list[Entry] = Field(
        ...,
        max_length=MAX_ENTRIES,
        description="Who may read (search, documents, originals, sources, jobs): "
        "user:<id>, group:<name> or key:<id>. Writers read too.",
    )
    writers: list[Entry] = Field(
        ...,
        max_length=MAX_ENTRIES,
        description="Who may also write (uploads, deletions, sources, settings).",
    )


class StoredAccess(BaseModel):
    readers: list[str]
    writers: list[str]
    updated_at: float


def _check_entry(entry: str, where: str) -> str:
    kind, sep, ident = entry.partition(":")
    ok = sep and kind in KINDS and (GROUP_RE.match(ident) if kind == "group" else ID_RE.match(ident))
    if not ok:
        raise InvalidRequest(
            f"{where}: {entry[:ENTRY_CHARS]!r} is not an access entry: use user:<id>, group:<name> or key:<id>",
            param=where,
        )
    return entry


def normal(acl: AccessList) -> AccessList:
    """The list with each entry checked (a 400 naming the first malformed one), deduplicated
    and sorted."""
    readers = [_check_entry(e, f"readers[{i}]") for i, e in enumerate(acl.readers)]
    writers = [_check_entry(e, f"writers[{i}]") for i, e in enumerate(acl.writers)]
    return AccessList(readers=sorted(set(readers)), writers=sorted(set(writers)))


def identities(principal: Principal) -> frozenset[str]:
    """The entries that name this caller: a user and its groups, or a key."""
    if principal.user_id:
        return frozenset({f"user:{principal.user_id}", *(f"group:{g}" for g in principal.groups)})
    return frozenset({f"key:{principal.key_id}"})


def may_read(principal: Principal, acl: AccessList | StoredAccess | None) -> bool:
    if acl is None or principal.is_admin:
        return True
    return not identities(principal).isdisjoint([*acl.readers, *acl.writers])


def may_write(principal: Principal, acl: AccessList | StoredAccess | None) -> bool:
    if principal.is_viewer:
        return False
    if acl is None or principal.is_admin:
        return True
    return not identities(principal).isdisjoint(acl.writers)


async def check_known(
    client: aioredis.Redis, tenant: str, acl: AccessList, kept: StoredAccess | None = None
) -> None:
    """A 404 naming the first entry that names no user, group or live key of the tenant. Entries
    the list had already (``kept``) are not checked again: removing one person from a list must
    not wait on another entry whose user has left since."""
    users = await UserStore(client).users(tenant)
    user_ids = {u.id for u in users}
    groups = {g for u in users for g in u.groups}
    old = set() if kept is None else {*kept.readers, *kept.writers}
    for where, entries in (("readers", acl.readers), ("writers", acl.writers)):
        for entry in entries:
            if entry in old:
                continue
            kind, _, ident = entry.partition(":")
            if kind == "user" and ident not in user_ids:
                raise NotFound(
                    f"{where}: no user with id {ident!r} in this tenant ({entry!r})",
                    param=where,
                    code="user_not_found",
                )
            if kind == "group" and ident not in groups:
                raise NotFound(
                    f"{where}: no user of this tenant is in group {ident!r} ({entry!r})",
                    param=where,
                    code="group_not_found",
                )
            if kind == "key" and not await _live_key(client, tenant, ident):
                raise NotFound(
                    f"{where}: no live API key with id {ident!r} in this tenant ({entry!r})",
                    param=where,
                    code="key_not_found",
                )


async def _live_key(client: aioredis.Redis, tenant: str, key_id: str) -> bool:
    data = await client.hgetall(f"tandem:keys:{key_id}")
    fields = {_text(k): _text(v) for k, v in dict(data).items()}
    return fields.get("tenant") == tenant and fields.get("revoked") == "0"


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class AccessStore:
    """The tenants' access lists in Redis. ``clock`` is settable (tests)."""

    def __init__(self, client: aioredis.Redis, clock: Callable[[], float] = time.time) -> None:
        self.r = client
        self.clock = clock

    @staticmethod
    def key(tenant: str) -> str:
        return f"tandem:access:{tenant}"

    async def get(self, tenant: str, collection: str) -> StoredAccess | None:
        raw = await self.r.hget(self.key(tenant), collection)
        return StoredAccess.model_validate_json(raw) if raw is not None else None

    async def all(self, tenant: str) -> dict[str, StoredAccess]:
        raw: dict[Any, Any] = await self.r.hgetall(self.key(tenant))
        return {_text(k): StoredAccess.model_validate_json(v) for k, v in raw.items()}

    async def put(self, tenant: str, collection: str, acl: AccessList) -> StoredAccess:
        stored = StoredAccess(readers=acl.readers, writers=acl.writers, updated_at=self.clock())
        await self.r.hset(self.key(tenant), collection, stored.model_dump_json())
        return stored

    async def delete(self, tenant: str, collection: str) -> StoredAccess | None:
        """Removes the list (the collection is open again); the list it had, if any."""
        before = await self.get(tenant, collection)
        await self.r.hdel(self.key(tenant), collection)
        return before


def as_detail(acl: AccessList | StoredAccess | None) -> dict[str, Any] | None:
    """An access list as an audit entry's detail records it (None: open to the tenant)."""
    return None if acl is None else {"readers": list(acl.readers), "writers": list(acl.writers)}


__all__ = [
    "AccessList",
    "AccessStore",
    "StoredAccess",
    "as_detail",
    "check_known",
    "identities",
    "may_read",
    "may_write",
    "normal",
]
