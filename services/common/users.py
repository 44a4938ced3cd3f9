"""People in a tenant, and their personal API tokens (the Redis layout is in services/common/auth.py).

A user has an email (unique in its tenant), a role (``admin``, ``member`` or ``viewer``) and
groups (names). A token is ``tdu_<id>_<secret>``, shown once and stored as a SHA-256 like a
key; it acts with its user's role as it is at each request, so a role change or a deletion
takes effect at once. Revoked tokens stay on record (``revoked``), so using one is a 401 that
says so.

A tenant always keeps an admin: its admins are its live admin keys and its admin users
together, and removing or demoting the last one is a 409.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from services.common.auth import (
    ADMIN,
    OPERATOR,
    TENANT_INDEX_BUILT,
    TOKEN_PREFIX,
    USER_ROLES,
    hash_key,
    tenant_role,
)
from services.common.errors import Conflict, InvalidRequest, NotFound

# One address: something@domain.tld, no spaces; RFC 5321 caps a path at 254 characters.
EMAIL_RE = re.compile(r"^[^@\s]{1,64}@[^@\s]+\.[^@\s]+$")
EMAIL_CHARS = 254
GROUP_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 _.:@/-]{0,63}$")
MAX_GROUPS = 64


class User(BaseModel):
    id: str
    email: str
    role: str = Field(description="admin, member or viewer")
    groups: list[str]
    created_at: float
    updated_at: float


class Token(BaseModel):
    """A token as listed: never the token itself."""

    id: str
    user_id: str
    name: str
    created_at: float
    last_used_at: float | None = Field(None, description="unix seconds; written at most once a minute")
    expires_at: float | None = None
    revoked: bool = False


class UserList(BaseModel):
    """``GET /v1/users``: the tenant's people."""

    data: list[User]


class TokenList(BaseModel):
    """``GET /v1/users/{user_id}/tokens``: a person's tokens, never the tokens themselves."""

    data: list[Token]


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _hash(raw: object) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in dict(raw).items()}  # type: ignore[call-overload]


def normal_email(email: str) -> str:
    email = email.strip().lower()
    if len(email) > EMAIL_CHARS or not EMAIL_RE.match(email):
        raise InvalidRequest(f"email: {email[:80]!r} is not an email address", param="email")
    return email


def check_groups(groups: list[str]) -> list[str]:
    for group in groups:
        if not GROUP_RE.match(group):
            raise InvalidRequest(
                f"groups: {group[:80]!r} is not a group name (1-64 letters, digits, spaces and '_.:@/-', "
                "starting with a letter or digit)",
                param="groups",
            )
    return sorted(set(groups))


def check_role(role: str) -> str:
    if role not in USER_ROLES:
        raise InvalidRequest(f"role: use {', '.join(USER_ROLES)} (got {role!r})", param="role")
    return role


def _user(user_id: str, data: dict[str, str]) -> User:
    return User(
        id=user_id,
        email=data["email"],
        role=data["role"],
        groups=json.loads(data.get("groups") or "[]"),
        created_at=float(data["created_at"]),
        updated_at=float(data.get("updated_at") or data["created_at"]),
    )


def _token(token_id: str, data: dict[str, str]) -> Token:
    return Token(
        id=token_id,
        user_id=data["user_id"],
        name=data.get("name", ""),
        created_at=float(data["created_at"]),
        last_used_at=float(data["last_used"]) if data.get("last_used") else None,
        expires_at=float(data["expires_at"]) if data.get("expires_at") else None,
        revoked=data.get("revoked") == "1",
    )


class UserStore:
    """Users and tokens of every tenant; every call names the tenant it acts in, and another
    tenant's user is a 404 as if it did not exist. ``clock`` is settable (tests)."""

    def __init__(self, client: aioredis.Redis, clock: Callable[[], float] = time.time) -> None:
        self.r = client
        self.clock = clock

    # -- users --------------------------------------------------------------------------------

    async def create(self, tenant: str, email: str, role: str, groups: list[str]) -> User:
        email, role, groups = normal_email(email), check_role(role), check_groups(groups)
        user_id = f"u_{secrets.token_hex(8)}"
        # claimed first, atomically: two requests with one address cannot both succeed
        if not await self.r.set(self._email_key(tenant, email), user_id, nx=True):
            raise Conflict(
                f"email: {email!r} is already a user of this tenant", param="email", code="email_taken"
            )
        now = self.clock()
        data = {
            "tenant": tenant,
            "email": email,
            "role": role,
            "groups": json.dumps(groups),
            "created_at": repr(now),
            "updated_at": repr(now),
        }
        pipe = self.r.pipeline()
        pipe.hset(f"tandem:users:{user_id}", mapping=data)  # type: ignore[arg-type]
        pipe.sadd(f"tandem:users:tenant:{tenant}", user_id)
        await pipe.execute()
        return _user(user_id, data)

    async def get(self, tenant: str, user_id: str) -> User:
        return _user(user_id, await self._data(tenant, user_id))

    async def find(self, tenant: str, email: str) -> User | None:
        """The tenant's user with this email; None when it has none."""
        found = await self.r.get(self._email_key(tenant, normal_email(email)))
        if found is None:
            return None
        try:
            return await self.get(tenant, _text(found))
        except NotFound:  # an address left claimed by a user removed halfway
            return None

    async def users(self, tenant: str) -> list[User]:
        out = []
        for raw in await self.r.smembers(f"tandem:users:tenant:{tenant}"):
            data = _hash(await self.r.hgetall(f"tandem:users:{_text(raw)}"))
            if data.get("tenant") == tenant:
                out.append(_user(_text(raw), data))
        return sorted(out, key=lambda u: (u.created_at, u.id))

    async def update(
        self,
        tenant: str,
        user_id: str,
        *,
        email: str | None = None,
        role: str | None = None,
        groups: list[str] | None = None,
    ) -> tuple[User, User]:
        """(before, after)."""
        data = await self._data(tenant, user_id)
        before = _user(user_id, data)
        changes: dict[str, str] = {}
        if role is not None and check_role(role) != before.role:
            if before.role == ADMIN:
                await self._keep_an_admin(tenant, f"demoting user {user_id!r} to {role}")
            changes["role"] = role
        if groups is not None:
            changes["groups"] = json.dumps(check_groups(groups))
        if email is not None and normal_email(email) != before.email:
            email = normal_email(email)
            if not await self.r.set(self._email_key(tenant, email), user_id, nx=True):
                raise Conflict(
                    f"email: {email!r} is already a user of this tenant", param="email", code="email_taken"
                )
            await self.r.delete(self._email_key(tenant, before.email))
            changes["email"] = email
        changes["updated_at"] = repr(self.clock())
        await self.r.hset(f"tandem:users:{user_id}", mapping=changes)  # type: ignore[arg-type]  # redis-py types a Mapping invariant in its keys
        return before, _user(user_id, {**data, **changes})

    async def delete(self, tenant: str, user_id: str) -> User:
        """Removes the user and revokes its tokens."""
        user = await self.get(tenant, user_id)
        if user.role == ADMIN:
            await self._keep_an_admin(tenant, f"removing user {user_id!r}")
        for token in await self.tokens(tenant, user_id):
            await self.r.hset(f"tandem:tokens:{token.id}", "revoked", "1")
        pipe = self.r.pipeline()
        pipe.delete(f"tandem:users:{user_id}")
        pipe.srem(f"tandem:users:tenant:{tenant}", user_id)
        pipe.delete(self._email_key(tenant, user.email))
        await pipe.execute()
        return user

    # -- tokens -------------------------------------------------------------------------------

    async def create_token(
        self, tenant: str, user_id: str, name: str, expires_at: float | None = None
    ) -> tuple[str, Token]:
        await self._data(tenant, user_id)  # 404 first
        now = self.clock()
        if expires_at is not None and expires_at <= now:
            raise InvalidRequest(
                f"expires_at: {expires_at} is not in the future (now is {now:.0f})", param="expires_at"
            )
        token_id = secrets.token_hex(6)
        token = f"{TOKEN_PREFIX}{token_id}_{secrets.token_urlsafe(32)}"
        digest = hash_key(token)
        data = {
            "user_id": user_id,
            "tenant": tenant,
            "name": name,
            "sha256": digest,
            "created_at": repr(now),
            "expires_at": repr(expires_at) if expires_at is not None else "",
            "revoked": "0",
        }
        pipe = self.r.pipeline()
        pipe.hset(f"tandem:tokens:{token_id}", mapping=data)  # type: ignore[arg-type]
        pipe.set(f"tandem:tokens:hash:{digest}", token_id)
        pipe.sadd(f"tandem:users:{user_id}:tokens", token_id)
        await pipe.execute()
        return token, _token(token_id, data)

    async def tokens(self, tenant: str, user_id: str) -> list[Token]:
        await self._data(tenant, user_id)
        out = []
        for raw in await self.r.smembers(f"tandem:users:{user_id}:tokens"):
            data = _hash(await self.r.hgetall(f"tandem:tokens:{_text(raw)}"))
            if data.get("tenant") == tenant:
                out.append(_token(_text(raw), data))
        return sorted(out, key=lambda t: (t.created_at, t.id))

    async def revoke_token(self, tenant: str, user_id: str, token_id: str) -> Token:
        await self._data(tenant, user_id)
        data = _hash(await self.r.hgetall(f"tandem:tokens:{token_id}"))
        if not data or data.get("user_id") != user_id or data.get("tenant") != tenant:
            raise NotFound(f"user {user_id!r} has no token with id {token_id!r}", param="token_id")
        await self.r.hset(f"tandem:tokens:{token_id}", "revoked", "1")
        return _token(token_id, {**data, "revoked": "1"})

    async def forget_ended(self, tenant: str, user_id: str, name: str) -> int:
        """Deletes ``user_id``'s tokens named ``name`` that are revoked or expired; how many.

        Browser sessions are tokens too, one per sign-in: without this every sign-in would leave
        a record behind for good. Only the caller's chosen kind goes (a personal token stays on
        record after revocation, so using it says it was revoked)."""
        now = self.clock()
        gone = 0
        for token in await self.tokens(tenant, user_id):
            ended = token.revoked or (token.expires_at is not None and token.expires_at <= now)
            if token.name != name or not ended:
                continue
            digest = await self.r.hget(f"tandem:tokens:{token.id}", "sha256")
            pipe = self.r.pipeline()
            pipe.delete(f"tandem:tokens:{token.id}")
            if digest is not None:
                pipe.delete(f"tandem:tokens:hash:{_text(digest)}")
            pipe.srem(f"tandem:users:{user_id}:tokens", token.id)
            await pipe.execute()
            gone += 1
        return gone

    # -- admins -------------------------------------------------------------------------------

    async def admins(self, tenant: str) -> int:
        """The tenant's live admin keys and admin users, together."""
        users = sum(1 for u in await self.users(tenant) if u.role == ADMIN)
        return users + await self._admin_keys(tenant)

    async def _admin_keys(self, tenant: str) -> int:
        if await self.r.exists(TENANT_INDEX_BUILT):
            ids = [_text(i) for i in await self.r.smembers(f"tandem:keys:tenant:{tenant}")]
        else:  # keys made before the per-tenant sets existed (KeyStore builds the index once)
            ids = [_text(i) for i in await self.r.smembers("tandem:keys:ids")]
        count = 0
        for key_id in ids:
            data = _hash(await self.r.hgetall(f"tandem:keys:{key_id}"))
            role = data.get("role")
            if data.get("tenant") == tenant and data.get("revoked") == "0" and role != OPERATOR:
                count += tenant_role(role) == ADMIN
        return count

    async def _keep_an_admin(self, tenant: str, what: str) -> None:
        if await self.admins(tenant) <= 1:
            raise Conflict(
                f"{what} would leave tenant {tenant!r} without an admin: make another user or key "
                "an admin first",
                code="last_admin",
            )

    # -- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _email_key(tenant: str, email: str) -> str:
        return f"tandem:users:email:{tenant}:{email}"

    async def _data(self, tenant: str, user_id: str) -> dict[str, str]:
        data = _hash(await self.r.hgetall(f"tandem:users:{user_id}"))
        if not data or data.get("tenant") != tenant:
            raise NotFound(
                f"no user with id {user_id!r} in this tenant", param="user_id", code="user_not_found"
            )
        return data
