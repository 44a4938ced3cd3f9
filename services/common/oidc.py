"""Sign-in with the organisation's OpenID provider, and the provider's JWTs as bearer tokens.

The provider is named by ``TANDEM_OIDC_ISSUER``; its endpoints and signing keys come from its
discovery document (``<issuer>/.well-known/openid-configuration``) and JWKS, both cached. Calls
to the issuer are not held to the outbound address guard (services/common/outbound.py): an
operator named it, and an organisation's provider often sits on its private network.

The web sign-in is the authorisation-code flow with PKCE (RFC 7636, S256)::

    browser -> GET /v1/auth/oidc/login          state, nonce and code verifier kept in Redis
            -> the provider's login page         (one use, ten minutes), state also in a cookie
            -> GET /v1/auth/oidc/callback        code + verifier exchanged at the token endpoint;
                                                 ID token checked; user found or created

An ID token is checked for its signature (an asymmetric algorithm, a key of the provider's
JWKS, fetched again once when the key id is new), issuer, audience, expiry, not-before and,
at sign-in, the nonce. A refusal is a 401 naming why ("expired", "bad signature", "wrong
audience", "wrong issuer", "wrong nonce").

A signed-in person is a user of one tenant (services/common/users.py): the tenant comes from
``TANDEM_OIDC_TENANT_CLAIM`` when the token carries it, else from the email's domain
(``TANDEM_OIDC_TENANT_DOMAINS``, only for an email the provider does not say is unverified); a
person mapping to no tenant is refused (403 naming why). A user is created at the first sign-in
with ``TANDEM_OIDC_DEFAULT_ROLE``; its groups follow the provider's groups claim at every
sign-in (when the provider sends the claim; without it, groups stay as an admin set them).

A bearer JWT whose issuer is the provider (an ID token, or an access token the provider issues
as a JWT) is accepted by every service with the same checks against ``TANDEM_OIDC_AUDIENCE``
(default: the client id), and stands for the same user.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote, urlencode, urlsplit

import httpx
import redis.asyncio as aioredis
from joserfc import jwk, jwt
from joserfc.errors import JoseError

from services.common.audit import Actor, AuditLog
from services.common.auth import Principal, validate_tenant
from services.common.config import CommonSettings
from services.common.errors import (
    Conflict,
    Forbidden,
    InvalidRequest,
    ServiceUnavailable,
    TandemError,
    Unauthorized,
)
from services.common.jsonsafe import JsonObject
from services.common.users import GROUP_RE, MAX_GROUPS, User, UserStore, normal_email

log = logging.getLogger("tandem.oidc")

# Signatures by the provider's published keys only: never "none", never a MAC (whose key a
# verifier would have to share), so a token cannot be made by anyone holding the public keys.
ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
DISCOVERY_TTL_S = 3600.0
# A JWKS is fetched again for an unknown key id (the provider rotated), at most this often.
JWKS_REFETCH_S = 60.0
LOGIN_TTL_S = 600
# Clock skew allowed between the provider and this service when checking exp, nbf and iat.
LEEWAY_S = 60.0
HTTP_TIMEOUT_S = 10.0
LOGIN_KEY = "tandem:oidc:login:"


def b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def pkce_challenge(verifier: str) -> str:
    """The S256 code challenge of a PKCE code verifier (RFC 7636, 4.2)."""
    return b64url(hashlib.sha256(verifier.encode()).digest())


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def _refused(why: str) -> Unauthorized:
    return Unauthorized(why, headers={"WWW-Authenticate": "Bearer"}, code="invalid_token")


@dataclass(frozen=True)
class ProviderMetadata:
    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    userinfo_endpoint: str | None = None


@dataclass(frozen=True)
class Identity:
    """Who a verified token names, in Tandem's terms."""

    tenant: str
    email: str
    # None: the provider sent no groups claim (the user's groups are left as they are)
    groups: list[str] | None
    subject: str


@dataclass(frozen=True)
class SignIn:
    """A finished sign-in: the ID token's claims and the page to return to."""

    claims: JsonObject
    next_route: str


class OidcProvider:
    """The configured OpenID provider: discovery, the code flow, JWT checks, users from claims.

    ``clock`` is settable (tests check expiry against it)."""

    def __init__(
        self,
        settings: CommonSettings,
        redis_client: aioredis.Redis,
        *,
        audit: AuditLog | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.issuer = settings.oidc_issuer
        self.client_id = settings.oidc_client_id
        self.client_secret = settings.oidc_client_secret
        self.audience = settings.oidc_audience or settings.oidc_client_id
        self.scopes = settings.oidc_scopes
        self.redirect_url = settings.oidc_redirect_url
        self.tenant_claim = settings.oidc_tenant_claim
        self.tenant_domains = settings.oidc_tenant_domain_map
        self.groups_claim = settings.oidc_groups_claim
        self.default_role = settings.oidc_default_role
        self.name = settings.oidc_name or urlsplit(settings.oidc_issuer).hostname or settings.oidc_issuer
        self.redis = redis_client
        self.users = UserStore(redis_client)
        self.audit = audit
        self.clock = clock
        self._metadata: tuple[float, ProviderMetadata] | None = None
        self._keys: dict[str, JsonObject] = {}
        self._keys_at = -JWKS_REFETCH_S

    @classmethod
    def from_settings(
        cls, settings: CommonSettings, redis_client: aioredis.Redis, audit: AuditLog | None = None
    ) -> OidcProvider | None:
        """The provider, or None when ``TANDEM_OIDC_ISSUER`` is unset."""
        return cls(settings, redis_client, audit=audit) if settings.oidc_issuer else None

    # -- the provider's documents -----------------------------------------------------------

    async def _get_json(self, url: str, what: str) -> JsonObject:
        try:
            async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as client:
                resp = await client.get(url, headers={"Accept": "application/json"})
        except httpx.HTTPError as exc:
            raise ServiceUnavailable(
                f"the OpenID provider is unreachable ({what} at {url}: {type(exc).__name__})"
            ) from exc
        if resp.status_code != 200:
            raise ServiceUnavailable(
                f"the OpenID provider answered {resp.status_code} for its {what} at {url}"
            )
        try:
            data = resp.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise ServiceUnavailable(f"the OpenID provider's {what} at {url} is not a JSON object")
        return data

    async def metadata(self) -> ProviderMetadata:
        now = self.clock()
        if self._metadata is not None and now - self._metadata[0] < DISCOVERY_TTL_S:
            return self._metadata[1]
        url = f"{self.issuer.rstrip('/')}/.well-known/openid-configuration"
        doc = await self._get_json(url, "discovery document")
        if doc.get("issuer") != self.issuer:
            # OpenID Connect Discovery 4.3: the document must name the issuer it was fetched for
            raise ServiceUnavailable(
                f"the discovery document at {url} names issuer {doc.get('issuer')!r}, "
                f"not TANDEM_OIDC_ISSUER {self.issuer!r}"
            )
        missing = [k for k in ("authorization_endpoint", "token_endpoint", "jwks_uri") if not doc.get(k)]
        if missing:
            raise ServiceUnavailable(f"the discovery document at {url} lacks {', '.join(missing)}")
        meta = ProviderMetadata(
            issuer=doc["issuer"],
            authorization_endpoint=doc["authorization_endpoint"],
            token_endpoint=doc["token_endpoint"],
            jwks_uri=doc["jwks_uri"],
            userinfo_endpoint=doc.get("userinfo_endpoint") or None,
        )
        self._metadata = (now, meta)
        return meta

    async def _signing_keys(self, kid: str | None) -> list[JsonObject]:
        """The JWKS keys that may have signed a token with this key id (all, without one)."""
        if (kid is None or kid not in self._keys) and self.clock() - self._keys_at >= JWKS_REFETCH_S:
            meta = await self.metadata()
            doc = await self._get_json(meta.jwks_uri, "key set")
            keys = [k for k in doc.get("keys", []) if isinstance(k, dict) and k.get("use", "sig") == "sig"]
            self._keys = {str(k.get("kid", i)): k for i, k in enumerate(keys)}
            self._keys_at = self.clock()
        if kid is None:
            return list(self._keys.values())
        return [self._keys[kid]] if kid in self._keys else []

    # -- checking a JWT ----------------------------------------------------------------------

    async def verify(self, token: str, *, what: str = "JWT", nonce: str | None = None) -> JsonObject:
        """The claims of a token the provider signed for this audience; 401 naming why not."""
        try:
            header = json.loads(base64.urlsafe_b64decode(token.split(".", 1)[0] + "=="))
        except ValueError:
            raise _refused(f"{what} refused: malformed (its header is not base64url JSON)") from None
        if not isinstance(header, dict):
            raise _refused(f"{what} refused: malformed (its header is not a JSON object)")
        alg, kid = header.get("alg"), header.get("kid")
        if alg not in ALGORITHMS:
            raise _refused(
                f"{what} refused: bad signature (algorithm {alg!r} is not accepted; "
                f"use one of {', '.join(ALGORITHMS)})"
            )
        candidates = await self._signing_keys(kid if isinstance(kid, str) else None)
        if not candidates:
            raise _refused(f"{what} refused: bad signature (the provider has no signing key with id {kid!r})")
        claims: JsonObject | None = None
        for key_data in candidates:
            try:
                decoded = jwt.decode(token, jwk.import_key(key_data), algorithms=[alg])
            except JoseError:
                continue
            except ValueError:  # a key of another type than the algorithm needs
                continue
            claims = dict(decoded.claims)
            break
        if claims is None:
            raise _refused(f"{what} refused: bad signature (not signed by the provider's key {kid!r})")
        self._check_claims(claims, what, nonce)
        return claims

    def _check_claims(self, claims: JsonObject, what: str, nonce: str | None) -> None:
        now = self.clock()
        if claims.get("iss") != self.issuer:
            raise _refused(f"{what} refused: wrong issuer ({claims.get('iss')!r}, not {self.issuer!r})")
        aud = claims.get("aud")
        audiences = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
        if self.audience not in audiences:
            raise _refused(
                f"{what} refused: wrong audience ({aud!r}; this service accepts {self.audience!r}, "
                "TANDEM_OIDC_AUDIENCE)"
            )
        exp = claims.get("exp")
        if not isinstance(exp, int | float) or isinstance(exp, bool):
            raise _refused(f"{what} refused: it has no expiry (exp)")
        if now > exp + LEEWAY_S:
            raise _refused(f"{what} refused: expired at {_when(exp)}")
        nbf = claims.get("nbf")
        if isinstance(nbf, int | float) and now + LEEWAY_S < nbf:
            raise _refused(f"{what} refused: not valid before {_when(nbf)}")
        if nonce is not None and not secrets.compare_digest(str(claims.get("nonce", "")), nonce):
            raise _refused(f"{what} refused: wrong nonce (it was not issued for this sign-in)")

    # -- the authorisation-code flow ---------------------------------------------------------

    async def begin(self, redirect_uri: str, next_route: str) -> tuple[str, str]:
        """(the provider's authorisation URL, the state) of a new sign-in."""
        meta = await self.metadata()
        state, nonce, verifier = (secrets.token_urlsafe(32) for _ in range(3))
        pending = {"nonce": nonce, "verifier": verifier, "redirect_uri": redirect_uri, "next": next_route}
        await self.redis.set(_login_key(state), json.dumps(pending), ex=LOGIN_TTL_S)
        params = {
            "response_type": "code",
            "client_id": self.client_id,
            "redirect_uri": redirect_uri,
            "scope": self.scopes,
            "state": state,
            "nonce": nonce,
            "code_challenge": pkce_challenge(verifier),
            "code_challenge_method": "S256",
        }
        joiner = "&" if "?" in meta.authorization_endpoint else "?"
        return f"{meta.authorization_endpoint}{joiner}{urlencode(params)}", state

    async def finish(self, state: str, code: str, browser_state: str | None) -> SignIn:
        """Exchanges the code of the sign-in ``state`` started (once) and checks its ID token."""
        raw = await self.redis.getdel(_login_key(state))
        if raw is None:
            raise InvalidRequest(
                "state: no sign-in is waiting for this state (it was used, or older than "
                f"{LOGIN_TTL_S // 60} minutes): sign in again",
                param="state",
            )
        if browser_state is None or not secrets.compare_digest(browser_state, state):
            # the state cookie binds the callback to the browser that started the sign-in
            raise InvalidRequest(
                "state: this sign-in was started in another browser (its state cookie is missing "
                "or different): sign in again",
                param="state",
            )
        pending = json.loads(raw)
        meta = await self.metadata()
        tokens = await self._exchange(meta, code, pending["redirect_uri"], pending["verifier"])
        id_token = tokens.get("id_token")
        if not isinstance(id_token, str):
            raise Unauthorized("the OpenID provider answered the code without an ID token (scope openid?)")
        claims = await self.verify(id_token, what="ID token", nonce=pending["nonce"])
        access = tokens.get("access_token")
        if "email" not in claims and meta.userinfo_endpoint and isinstance(access, str):
            claims = {**await self._userinfo(meta.userinfo_endpoint, access, claims.get("sub")), **claims}
        return SignIn(claims, pending["next"])

    async def _exchange(
        self, meta: ProviderMetadata, code: str, redirect_uri: str, verifier: str
    ) -> JsonObject:
        form = {
            "grant_type": "authorization_code",
            "code": code,
            "redirect_uri": redirect_uri,
            "code_verifier": verifier,
        }
        headers: dict[str, str] = {"Accept": "application/json"}
        if self.client_secret:  # client_secret_basic, the method every provider supports
            pair = f"{quote(self.client_id, safe='')}:{quote(self.client_secret, safe='')}"
            headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        else:
            form["client_id"] = self.client_id  # a public client: PKCE alone
        try:
            async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as client:
                resp = await client.post(meta.token_endpoint, data=form, headers=headers)
        except httpx.HTTPError as exc:
            raise ServiceUnavailable(
                f"the OpenID provider's token endpoint is unreachable ({type(exc).__name__})"
            ) from exc
        try:
            body = resp.json()
        except ValueError:
            body = {}
        if resp.status_code != 200 or not isinstance(body, dict):
            err = body.get("error", resp.status_code) if isinstance(body, dict) else resp.status_code
            desc = body.get("error_description", "") if isinstance(body, dict) else ""
            raise Unauthorized(
                f"the OpenID provider refused the sign-in code: {err}" + (f" ({desc})" if desc else "")
            )
        return body

    async def _userinfo(self, url: str, access_token: str, subject: object) -> JsonObject:
        try:
            async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as client:
                resp = await client.get(url, headers={"Authorization": f"Bearer {access_token}"})
            info = resp.json() if resp.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            info = {}
        # OpenID Connect Core 5.3.2: the userinfo's sub must be the ID token's, else it is not used
        return info if isinstance(info, dict) and info.get("sub") == subject else {}

    # -- users from claims --------------------------------------------------------------------

    def identity(self, claims: JsonObject) -> Identity:
        """The tenant, email and groups a verified token names; 403 naming why it maps to none."""
        subject = str(claims.get("sub", ""))
        raw_email = claims.get("email")
        if not isinstance(raw_email, str) or not raw_email:
            raise Forbidden(
                f"the OpenID provider sent no email for {subject!r}: ask for the email scope "
                "(TANDEM_OIDC_SCOPES) or have the provider put email in its tokens",
                code="no_email",
            )
        try:
            email = normal_email(raw_email)
        except InvalidRequest:
            raise Forbidden(
                f"the OpenID provider's email {raw_email[:80]!r} is not an email address"
            ) from None
        domain = email.rsplit("@", 1)[1]
        tenant: str | None = None
        claimed = claims.get(self.tenant_claim) if self.tenant_claim else None
        if isinstance(claimed, str) and claimed:
            tenant = claimed
        elif domain in self.tenant_domains:
            if claims.get("email_verified") is False:
                raise Forbidden(
                    f"{email} is not verified by the OpenID provider, so its domain does not place it "
                    "in a tenant",
                    code="email_unverified",
                )
            tenant = self.tenant_domains[domain]
        if tenant is None:
            claim_part = f"it has no {self.tenant_claim!r} claim and " if self.tenant_claim else ""
            raise Forbidden(
                f"{email} belongs to no tenant: {claim_part}its domain {domain!r} is not in "
                "TANDEM_OIDC_TENANT_DOMAINS",
                code="no_tenant",
            )
        try:
            validate_tenant(tenant)
        except InvalidRequest:
            raise Forbidden(
                f"the {self.tenant_claim!r} claim of {email} is {tenant[:80]!r}, not a tenant name",
                code="no_tenant",
            ) from None
        return Identity(tenant, email, self._groups(claims.get(self.groups_claim), email), subject)

    def _groups(self, raw: object, email: str) -> list[str] | None:
        if raw is None:
            return None
        names = [raw] if isinstance(raw, str) else raw if isinstance(raw, list) else []
        kept = sorted({g for g in names if isinstance(g, str) and GROUP_RE.match(g)})
        dropped = [g for g in names if not (isinstance(g, str) and GROUP_RE.match(g))]
        if dropped:
            log.warning("groups of %s that are not group names were left out: %r", email, dropped[:10])
        return kept[:MAX_GROUPS]

    async def user_of(self, who: Identity, via: str = "oidc") -> tuple[User, bool]:
        """The tenant's user with this email, made now when it has none (True, and a
        ``user.create`` audit entry saying ``via``); its groups follow the provider's."""
        user = await self.users.find(who.tenant, who.email)
        created = False
        if user is None:
            try:
                user = await self.users.create(who.tenant, who.email, self.default_role, who.groups or [])
                created = True
                if self.audit is not None:
                    await self.audit.record(
                        who.tenant,
                        Actor(kind="user", id=user.id),
                        "user.create",
                        user.id,
                        {"email": user.email, "role": user.role, "via": via},
                    )
            except Conflict:  # a sign-in of the same person a moment ago made it
                user = await self.users.find(who.tenant, who.email)
                if user is None:
                    raise
        if who.groups is not None and user.groups != who.groups:
            _, user = await self.users.update(who.tenant, user.id, groups=who.groups)
        return user, created

    # -- bearer JWTs (services/common/auth.py's JwtAuthenticator) -----------------------------

    async def principal(self, token: str) -> Principal:
        claims = await self.verify(token)
        try:
            who = self.identity(claims)
        except TandemError as exc:
            raise _refused(f"JWT refused: {exc.message}") from None
        user, created = await self.user_of(who, via="bearer JWT")
        if created:
            log.info("user %s (%s) of tenant %s created from a bearer JWT", user.id, user.email, who.tenant)
        return Principal(
            tenant=who.tenant,
            key_id=user.id,
            role=user.role,
            user_id=user.id,
            groups=tuple(user.groups),
        )


def _login_key(state: str) -> str:
    # the state itself is a bearer secret of one sign-in: Redis holds its hash
    return LOGIN_KEY + hashlib.sha256(state.encode()).hexdigest()
