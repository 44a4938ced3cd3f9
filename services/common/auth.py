"""API keys with tenants.

Keys look like ``tdm_<id>_<secret>``. Only a SHA-256 of the whole key is stored:
keys carry 256 bits of randomness, so a fast hash is enough (a slow password
hash protects low-entropy secrets, which these are not) and keeps the check
per request cheap. Keys live in Redis so that every service, in one process or
in many containers, sees the same keys and revocations at once.

Redis layout::

    tandem:keys:hash:<sha256>  -> key id
    tandem:keys:<id>           -> hash {tenant, name, sha256, created_at, revoked, role}
    tandem:keys:ids            -> set of key ids
    tandem:keys:tenant:<tenant> -> set of the tenant's key ids (built from the above once,
                                  ``tandem:keys:tenant-index`` marks it built)

``role`` is ``operator`` for operator keys (``tandem keys create --operator``, and the
service-to-service key ``tandem up`` creates): they may load, unload and register models
for everyone. Otherwise it is the key's role in its tenant:

- ``admin``: sees all of the tenant's answers, feedback and conversations, trains the tenant's
  model on its feedback, promotes and rolls back its models. Keys without the field (made
  before tenant roles existed) are admins, and so is a tenant's first key by default.
- ``member``: sees, rates and corrects only the answers it asked for itself; another key's
  answer is a 404, as if it did not exist. A tenant's later keys are members by default.

A principal's ``owner`` is what its answers are recorded under (the key id; a signed-in
user's id once people sign in), so the checks above compare owners, not keys.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis
from fastapi import Request, WebSocketException
from starlette.requests import HTTPConnection

from services.common.errors import Forbidden, InvalidRequest, NotFound, Unauthorized

TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
KEY_PREFIX = "tdm_"
WS_PROTOCOL = "tandem.bearer"
OPERATOR = "operator"
ADMIN = "admin"
MEMBER = "member"
TENANT_ROLES = (ADMIN, MEMBER)
# Tandem extension: an operator key acting for one tenant (the trainer's worker writing a job's
# questions with the model that job's tenant named) sends the tenant here; see ``acting_principal``.
ACT_FOR_HEADER = "X-Tandem-Tenant"
TENANT_INDEX_BUILT = "tandem:keys:tenant-index"


@dataclass(frozen=True)
class Principal:
    tenant: str
    key_id: str
    operator: bool = False
    # The role in the tenant (``admin`` or ``member``); the least one unless said otherwise.
    role: str = MEMBER

    @property
    def owner(self) -> str:
        """Whose answers these are: the key id of the key that asked."""
        return self.key_id

    @property
    def is_admin(self) -> bool:
        return self.operator or self.role == ADMIN


@dataclass(frozen=True)
class KeyRecord:
    key_id: str
    tenant: str
    name: str
    created_at: float
    revoked: bool
    operator: bool = False
    role: str = ADMIN

    @property
    def role_label(self) -> str:
        return OPERATOR if self.operator else self.role


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def validate_tenant(tenant: str) -> str:
    if not TENANT_RE.match(tenant):
        raise InvalidRequest(
            f"invalid tenant {tenant!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit",
            param="tenant",
        )
    return tenant


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _text_dict(raw: object) -> dict[str, str]:
    """Redis hashes as str→str (clients are made with decode_responses; this keeps mypy honest)."""
    return {_text(k): _text(v) for k, v in dict(raw).items()}  # type: ignore[call-overload]


def tenant_role(stored: str | None) -> str:
    """The tenant role of a key's stored ``role``: ``member`` only where it says so (a key made
    before tenant roles existed, and an operator key, administer their tenant)."""
    return MEMBER if stored == MEMBER else ADMIN


def _record(key_id: str, data: dict[str, str]) -> KeyRecord:
    return KeyRecord(
        key_id=key_id,
        tenant=data["tenant"],
        name=data.get("name", ""),
        created_at=float(data.get("created_at", 0)),
        revoked=data.get("revoked") == "1",
        operator=data.get("role") == OPERATOR,
        role=tenant_role(data.get("role")),
    )


def require_admin(principal: Principal, what: str) -> None:
    """403 ``forbidden`` unless the caller administers its tenant (an admin or operator key)."""
    if not principal.is_admin:
        raise Forbidden(
            f"{what} needs a tenant admin key (`tandem keys create --role admin`); this key is a member",
            code="forbidden",
        )


class KeyStore:
    """Create, list and revoke keys (used by the CLI; synchronous)."""

    def __init__(self, client: redis.Redis) -> None:
        self.r = client

    def create(
        self, tenant: str, name: str = "", *, operator: bool = False, role: str | None = None
    ) -> tuple[str, KeyRecord]:
        """``role``: ``admin`` or ``member``; None gives ``admin`` to a tenant's first key (none of
        its keys is live) and ``member`` to the later ones."""
        validate_tenant(tenant)
        if role is not None and role not in TENANT_ROLES:
            raise InvalidRequest(f"role: use {' or '.join(TENANT_ROLES)} (got {role!r})", param="role")
        if role is None:
            role = MEMBER if self._has_live_key(tenant) else ADMIN
        key_id = secrets.token_hex(6)
        key = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
        digest = hash_key(key)
        created = time.time()
        pipe = self.r.pipeline()
        pipe.hset(
            f"tandem:keys:{key_id}",
            mapping={
                "tenant": tenant,
                "name": name,
                "sha256": digest,
                "created_at": str(created),
                "revoked": "0",
                "role": OPERATOR if operator else role,
            },
        )
        pipe.set(f"tandem:keys:hash:{digest}", key_id)
        pipe.sadd("tandem:keys:ids", key_id)
        pipe.sadd(f"tandem:keys:tenant:{tenant}", key_id)
        pipe.execute()
        return key, KeyRecord(key_id, tenant, name, created, False, operator, ADMIN if operator else role)

    def _has_live_key(self, tenant: str) -> bool:
        if not self.r.exists(TENANT_INDEX_BUILT):
            # keys made before the per-tenant sets existed: index them once, not per call
            for raw_id in self.r.smembers("tandem:keys:ids"):
                key_id = _text(raw_id)
                owner = self.r.hget(f"tandem:keys:{key_id}", "tenant")
                if owner is not None:
                    self.r.sadd(f"tandem:keys:tenant:{_text(owner)}", key_id)
            self.r.set(TENANT_INDEX_BUILT, "1")
        for raw_id in self.r.smembers(f"tandem:keys:tenant:{tenant}"):
            revoked = self.r.hget(f"tandem:keys:{_text(raw_id)}", "revoked")
            if revoked is not None and _text(revoked) == "0":
                return True
        return False

    def make_operator(self, key: str) -> KeyRecord | None:
        """Give an existing key (the whole key) the operator role; None if it is unknown or revoked.

        ``tandem up`` uses it on a service key created before roles existed."""
        found = self.r.get(f"tandem:keys:hash:{hash_key(key)}")
        if not found:
            return None
        key_id = _text(found)
        data = _text_dict(self.r.hgetall(f"tandem:keys:{key_id}"))
        if not data or data.get("revoked") == "1":
            return None
        self.r.hset(f"tandem:keys:{key_id}", "role", OPERATOR)
        return _record(key_id, {**data, "role": OPERATOR})

    def revoke(self, key_id: str) -> KeyRecord:
        """Revoke by key id, or by the whole key."""
        if key_id.startswith(KEY_PREFIX):
            found = self.r.get(f"tandem:keys:hash:{hash_key(key_id)}")
            if not found:
                raise NotFound("no such API key", param="key")
            key_id = _text(found)
        data = _text_dict(self.r.hgetall(f"tandem:keys:{key_id}"))
        if not data:
            raise NotFound(f"no API key with id {key_id!r}", param="key_id")
        self.r.hset(f"tandem:keys:{key_id}", "revoked", "1")
        self.r.delete(f"tandem:keys:hash:{data['sha256']}")
        return _record(key_id, {**data, "revoked": "1"})

    def list(self, tenant: str | None = None) -> list[KeyRecord]:
        out = []
        for raw_id in self.r.smembers("tandem:keys:ids"):
            key_id = _text(raw_id)
            data = _text_dict(self.r.hgetall(f"tandem:keys:{key_id}"))
            if data and (tenant is None or data["tenant"] == tenant):
                out.append(_record(key_id, data))
        return sorted(out, key=lambda r: r.created_at)


async def verify_key(client: aioredis.Redis, key: str) -> Principal | None:
    if not key.startswith(KEY_PREFIX):
        return None
    found = await client.get(f"tandem:keys:hash:{hash_key(key)}")
    if not found:
        return None
    key_id = _text(found)
    data = _text_dict(await client.hgetall(f"tandem:keys:{key_id}"))
    if not data or data.get("revoked") == "1":
        return None
    return Principal(
        tenant=data["tenant"],
        key_id=key_id,
        operator=data.get("role") == OPERATOR,
        role=tenant_role(data.get("role")),
    )


async def key_names(client: aioredis.Redis, key_ids: list[str]) -> dict[str, str]:
    """The names (labels) of these keys; a key that no longer exists is left out."""
    out: dict[str, str] = {}
    for key_id in key_ids:
        name = await client.hget(f"tandem:keys:{key_id}", "name")  # type: ignore[misc]
        if name is not None:
            out[key_id] = _text(name)
    return out


def bearer_token(conn: HTTPConnection) -> str | None:
    """The key from ``Authorization: Bearer``, or, for browser websockets (which
    cannot set headers), from the subprotocols ``tandem.bearer, <key>``; never from the URL."""
    header = conn.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    if conn.scope.get("type") == "websocket":
        protocols = [p.strip() for p in conn.headers.get("sec-websocket-protocol", "").split(",")]
        if WS_PROTOCOL in protocols:
            idx = protocols.index(WS_PROTOCOL)
            if idx + 1 < len(protocols):
                return protocols[idx + 1]
    return None


async def require_principal(conn: HTTPConnection) -> Principal:
    """FastAPI dependency guarding every route except health and metrics.

    For HTTP the guard middleware (services/common/guard.py) has already checked the key
    before the body was read; its principal is reused here."""
    known = conn.scope.get("state", {}).get("principal")
    if isinstance(known, Principal):
        return known
    token = bearer_token(conn)
    is_ws = conn.scope.get("type") == "websocket"
    if token is None:
        if is_ws:
            # Error handlers do not run for websockets: close with "policy violation".
            raise WebSocketException(code=1008, reason="missing API key")
        raise Unauthorized(
            "missing API key: send 'Authorization: Bearer <key>'", headers={"WWW-Authenticate": "Bearer"}
        )
    principal = await verify_key(conn.app.state.redis, token)
    if principal is None:
        if is_ws:
            raise WebSocketException(code=1008, reason="invalid or revoked API key")
        raise Unauthorized("invalid or revoked API key", headers={"WWW-Authenticate": "Bearer"})
    conn.state.principal = principal
    return principal


def principal_of(request: Request) -> Principal:
    principal = getattr(request.state, "principal", None)
    if not isinstance(principal, Principal):
        raise Unauthorized("not authenticated")
    return principal


def acting_principal(request: Request) -> Principal:
    """The caller; or, for an operator key sending ``X-Tandem-Tenant: <tenant>``, that tenant as
    a plain tenant principal: it sees and uses exactly that tenant's models (its own and the
    shared ones) and nothing the operator could reach beyond them. A tenant key sending the
    header is a 403 (a tenant never acts for another)."""
    principal = principal_of(request)
    tenant = request.headers.get(ACT_FOR_HEADER)
    if tenant is None:
        return principal
    if not principal.operator:
        raise Forbidden(
            f"{ACT_FOR_HEADER}: only an operator key may act for a tenant",
            param=ACT_FOR_HEADER,
            code="forbidden",
        )
    try:
        validate_tenant(tenant)
    except InvalidRequest as exc:
        raise InvalidRequest(f"{ACT_FOR_HEADER}: {exc.message}", param=ACT_FOR_HEADER) from None
    # the service acting for the tenant as a whole, as its admin would
    return Principal(tenant=tenant, key_id=principal.key_id, operator=False, role=ADMIN)


def require_operator(request: Request) -> Principal:
    """The caller, who must hold an operator key (403 ``forbidden`` otherwise)."""
    principal = principal_of(request)
    if not principal.operator:
        raise Forbidden(
            f"{request.method} {request.url.path} needs an operator key (`tandem keys create --operator`)",
            code="forbidden",
        )
    return principal
