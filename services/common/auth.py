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

People have accounts too (services/common/users.py): a user's personal token looks like
``tdu_<id>_<secret>`` and is stored the same way, so it works wherever a key works, with the
user's role (``admin``, ``member`` or ``viewer``) read at every request::

    tandem:tokens:hash:<sha256> -> token id (kept after revocation, so a revoked token says so)
    tandem:tokens:<id>          -> hash {user_id, tenant, name, sha256, created_at, last_used,
                                   expires_at, revoked}
    tandem:users:<id>           -> hash {tenant, email, role, groups (JSON), created_at, updated_at}

- ``viewer`` (users only): chats and searches; the routes that write (uploads and collection
  changes, feedback, training, evaluations, MCP servers, models) answer 403 naming the role
  (``viewer_refusal``, applied by the guard to every service).

The web front end signs people in through the organisation's OpenID provider
(services/common/oidc.py, services/common/sessions.py): a browser session is a user token like
any other, held in the HttpOnly cookie ``tandem_session``. ``credential`` reads the bearer
header first, then that cookie; a state-changing request the cookie authenticates must carry
``X-CSRF-Token`` (``csrf_refusal``), and a websocket it authenticates must come from the page's
own origin. A bearer JWT issued by the configured provider is checked by the verifier the
service holds (``JwtAuthenticator``) and stands for its user.

A principal's ``owner`` is what its answers are recorded under: the key id, or a user's id
(``key_id`` holds it for a user, so every token of one person shares its answers), so the
checks above compare owners, not keys.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis
from fastapi import Request, WebSocketException
from starlette.requests import HTTPConnection

from services.common.errors import Forbidden, InvalidRequest, NotFound, TandemError, Unauthorized

TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
KEY_PREFIX = "tdm_"
TOKEN_PREFIX = "tdu_"
WS_PROTOCOL = "tandem.bearer"
OPERATOR = "operator"
ADMIN = "admin"
MEMBER = "member"
VIEWER = "viewer"
# The roles a key may have in its tenant; a user may also be a viewer.
TENANT_ROLES = (ADMIN, MEMBER)
USER_ROLES = (ADMIN, MEMBER, VIEWER)
# A token's ``last_used`` is written at most this often (seconds): not one write per request.
LAST_USED_EVERY_S = 60.0
# Tandem extension: an operator key acting for one tenant (the trainer's worker writing a job's
# questions with the model that job's tenant named) sends the tenant here; see ``acting_principal``.
ACT_FOR_HEADER = "X-Tandem-Tenant"
TENANT_INDEX_BUILT = "tandem:keys:tenant-index"
# A browser session: a user token in an HttpOnly cookie (services/common/sessions.py).
SESSION_COOKIE = "tandem_session"
CSRF_HEADER = "X-CSRF-Token"


@dataclass(frozen=True)
class Principal:
    tenant: str
    key_id: str
    operator: bool = False
    # The role in the tenant (``admin``, ``member`` or ``viewer``); a member unless said otherwise.
    role: str = MEMBER
    # Set for a person's token: the user (``key_id`` is then the user's id too) and its groups.
    user_id: str | None = None
    groups: tuple[str, ...] = ()

    @property
    def owner(self) -> str:
        """Whose answers these are: the key id of the key that asked."""
        return self.key_id

    @property
    def is_admin(self) -> bool:
        return self.operator or self.role == ADMIN

    @property
    def is_viewer(self) -> bool:
        return not self.operator and self.role == VIEWER


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
        holder = "user" if principal.user_id else "key"
        raise Forbidden(
            f"{what} needs a tenant admin key (`tandem keys create --role admin`) or an admin user; "
            f"this {holder} is a {principal.role}",
            code="forbidden",
        )


def refuse_viewer(principal: Principal, what: str) -> None:
    """403 ``forbidden`` naming the role when a viewer tries ``what`` (a write)."""
    if principal.is_viewer:
        raise Forbidden(
            f"{what}: this user has the viewer role, which may chat and search only; "
            "it needs the member or admin role",
            code="forbidden",
        )


# The route templates whose writes (any method but GET, HEAD, OPTIONS) a viewer may not make,
# by what they are, across the four services: a viewer chats (pipelines, the OpenAI facade,
# the Responses API, websockets) and searches, and keeps its own conversations.
VIEWER_WRITES = (
    ("/v1/collections", "uploading documents or changing collections"),
    ("/v1/jobs", "training and ingestion jobs"),
    ("/v1/files", "uploading training files"),
    ("/v1/feedback", "feedback"),
    ("/v1/messages/", "feedback"),
    ("/v1/evals", "evaluations"),
    ("/v1/mcp/servers", "registering MCP servers"),
    ("/v1/models", "changing models"),
)
# Write-method routes under a prefix above that a viewer may call: a search reads, and a
# regenerated answer is another chat turn (choosing between drafts is feedback, and refused).
# /v1/users is not above: its routes let anyone manage their own tokens, and only admins more.
VIEWER_READS = ("/search", "/regenerate")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def viewer_refusal(principal: Principal, method: str, template: str) -> Forbidden | None:
    """The 403 for a viewer calling a route that writes; None when the call is allowed."""
    if not principal.is_viewer or method.upper() in SAFE_METHODS or template.endswith(VIEWER_READS):
        return None
    for prefix, what in VIEWER_WRITES:
        if template.startswith(prefix):
            try:
                refuse_viewer(principal, f"{method.upper()} {template} ({what})")
            except Forbidden as exc:
                return exc
    return None


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


class JwtAuthenticator(Protocol):
    """Checks a bearer JWT of the configured OpenID provider (services/common/oidc.py)."""

    async def principal(self, token: str) -> Principal:
        """The token's user; 401 ``Unauthorized`` naming why not (expired, bad signature, ...)."""
        ...


def looks_like_jwt(token: str) -> bool:
    """A compact JWS (``header.payload.signature``, the header's JSON starting ``{"``)."""
    return token.startswith("eyJ") and token.count(".") == 2


async def verify_key(
    client: aioredis.Redis, key: str, jwt: JwtAuthenticator | None = None
) -> Principal | None:
    """The principal of a key or user token; None for anything not (or no longer) valid."""
    try:
        return await authenticate(client, key, jwt=jwt)
    except TandemError:
        return None


async def authenticate(
    client: aioredis.Redis, token: str, now: float | None = None, *, jwt: JwtAuthenticator | None = None
) -> Principal:
    """The principal of a tenant key, a user's token, or a JWT of the configured OpenID provider
    (checked by ``jwt``); 401 ``Unauthorized`` saying why not (unknown, revoked, expired, bad
    signature, wrong audience)."""
    if looks_like_jwt(token):
        if jwt is None:
            raise Unauthorized(
                "a JWT was sent, but no OpenID provider is configured (TANDEM_OIDC_ISSUER): "
                "use an API key or a personal token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await jwt.principal(token)
    if token.startswith(TOKEN_PREFIX):
        return await _user_principal(client, token, time.time() if now is None else now)
    found = await client.get(f"tandem:keys:hash:{hash_key(token)}") if token.startswith(KEY_PREFIX) else None
    data = _text_dict(await client.hgetall(f"tandem:keys:{_text(found)}")) if found else {}
    if not found or not data or data.get("revoked") == "1":
        raise Unauthorized("invalid or revoked API key", headers={"WWW-Authenticate": "Bearer"})
    return Principal(
        tenant=data["tenant"],
        key_id=_text(found),
        operator=data.get("role") == OPERATOR,
        role=tenant_role(data.get("role")),
    )


async def _user_principal(client: aioredis.Redis, token: str, now: float) -> Principal:
    def refused(why: str) -> Unauthorized:
        return Unauthorized(why, headers={"WWW-Authenticate": "Bearer"})

    found = await client.get(f"tandem:tokens:hash:{hash_key(token)}")
    if not found:
        raise refused("invalid user token (no such token)")
    token_id = _text(found)
    data = _text_dict(await client.hgetall(f"tandem:tokens:{token_id}"))
    if not data:
        raise refused("invalid user token (no such token)")
    if data.get("revoked") == "1":
        raise refused(f"user token {token_id} was revoked")
    expires = float(data.get("expires_at") or 0)
    if expires and now >= expires:
        raise refused(
            f"user token {token_id} expired at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(expires))}"
        )
    user = _text_dict(await client.hgetall(f"tandem:users:{data['user_id']}"))
    if not user or user.get("tenant") != data.get("tenant"):
        raise refused(f"user token {token_id} was revoked (its user no longer exists)")
    if now - float(data.get("last_used") or 0) >= LAST_USED_EVERY_S:
        await client.hset(f"tandem:tokens:{token_id}", "last_used", str(now))
    role = user.get("role", VIEWER)
    return Principal(
        tenant=user["tenant"],
        key_id=data["user_id"],
        role=role if role in USER_ROLES else VIEWER,
        user_id=data["user_id"],
        groups=tuple(json.loads(user.get("groups") or "[]")),
    )


async def key_names(client: aioredis.Redis, key_ids: list[str]) -> dict[str, str]:
    """The names (labels) of these keys; a key that no longer exists is left out."""
    out: dict[str, str] = {}
    for key_id in key_ids:
        name = await client.hget(f"tandem:keys:{key_id}", "name")
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


@dataclass(frozen=True)
class Credential:
    token: str
    # Read from the session cookie: the browser sends it by itself, so a write needs the CSRF header.
    from_cookie: bool = False


def credential(conn: HTTPConnection) -> Credential | None:
    """What authenticates the request: the bearer header (or websocket subprotocol), else the
    session cookie of a signed-in browser."""
    token = bearer_token(conn)
    if token is not None:
        return Credential(token)
    cookie = conn.cookies.get(SESSION_COOKIE, "")
    if cookie.startswith(TOKEN_PREFIX):
        return Credential(cookie, from_cookie=True)
    return None


def csrf_token(session: str) -> str:
    """The CSRF value of a session: a page of the front end reads it from GET /v1/auth/session;
    another site can neither read that answer nor derive it from the HttpOnly cookie."""
    return hashlib.sha256(f"tandem-csrf:{session}".encode()).hexdigest()


def _host(value: str) -> str:
    return value.strip().lower()


def csrf_refusal(conn: HTTPConnection, cred: Credential) -> Forbidden | None:
    """The 403 for a cookie-authenticated write without the session's ``X-CSRF-Token``, or a
    cookie-authenticated websocket from another origin; None when the request may go on."""
    if not cred.from_cookie:
        return None
    if conn.scope.get("type") == "websocket":
        origin = conn.headers.get("origin", "")
        if origin and _host(urlsplit(origin).netloc) == _host(conn.headers.get("host", "")):
            return None
        return Forbidden(
            f"websocket signed in by the session cookie from origin {origin or '(none)'!r}, "
            f"not this site ({conn.headers.get('host', '')!r})",
            code="csrf",
        )
    if conn.scope.get("method", "GET").upper() in SAFE_METHODS:
        return None
    sent = conn.headers.get(CSRF_HEADER.lower())
    if not sent:
        return Forbidden(
            f"missing {CSRF_HEADER} header: a {conn.scope.get('method')} signed in by the session cookie "
            "must send the csrf value GET /v1/auth/session answers",
            param=CSRF_HEADER,
            code="csrf",
        )
    if not hmac.compare_digest(sent.encode(), csrf_token(cred.token).encode()):
        return Forbidden(
            f"{CSRF_HEADER} header does not match this session (sign in again, or read it from "
            "GET /v1/auth/session)",
            param=CSRF_HEADER,
            code="csrf",
        )
    return None


def jwt_authenticator(conn: HTTPConnection) -> JwtAuthenticator | None:
    """The service's checker of the OpenID provider's JWTs (None when no provider is set)."""
    found: JwtAuthenticator | None = getattr(conn.app.state, "oidc", None)
    return found


async def require_principal(conn: HTTPConnection) -> Principal:
    """FastAPI dependency guarding every route except health and metrics.

    For HTTP the guard middleware (services/common/guard.py) has already checked the key
    before the body was read; its principal is reused here."""
    known = conn.scope.get("state", {}).get("principal")
    if isinstance(known, Principal):
        return known
    cred = credential(conn)
    is_ws = conn.scope.get("type") == "websocket"
    if cred is None:
        if is_ws:
            # Error handlers do not run for websockets: close with "policy violation".
            raise WebSocketException(code=1008, reason="missing API key")
        raise Unauthorized(
            "missing API key: send 'Authorization: Bearer <key>'", headers={"WWW-Authenticate": "Bearer"}
        )
    try:
        principal = await authenticate(conn.app.state.redis, cred.token, jwt=jwt_authenticator(conn))
        refusal = csrf_refusal(conn, cred)
        if refusal is not None:
            raise refusal
    except TandemError as exc:
        if is_ws:
            raise WebSocketException(code=1008, reason=exc.message[:120]) from None
        raise
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
