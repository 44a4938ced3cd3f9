"""Settings: one pydantic-settings class per service plus the shared ones.

Every variable starts with ``TANDEM_``. Shared settings use the bare prefix
(``TANDEM_HOME``); a service's own settings use ``TANDEM_<SERVICE>_``
(``TANDEM_INFERENCE_MODEL``). A bad value, or a ``TANDEM_`` variable that no
settings class knows, stops start-up with a message naming the variable.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

SERVICE_NAMES = ("agent", "inference", "retrieval", "trainer")
DEFAULT_PORTS = {"agent": 8000, "inference": 8001, "retrieval": 8002, "trainer": 8003}

DeviceName = Literal["auto", "cuda", "xpu", "npu", "mps", "cpu"]
# Weights dtype of a model a service loads; auto: the platform's default.
ModelDType = Literal["auto", "float32", "bfloat16", "float16"]


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` unless it already carries one (its own wins)."""
    parts = urlsplit(url)
    if parts.password or parts.scheme == "unix" or not parts.hostname:
        return url
    user = quote(parts.username or "", safe="")
    netloc = f"{user}:{quote(password, safe='')}@{parts.netloc.rsplit('@', 1)[-1]}"
    return urlunsplit(parts._replace(netloc=netloc))


def tenant_domains(value: str) -> dict[str, str]:
    """``example.com=acme,example.org=beta`` as {domain: tenant}; ValueError naming a bad pair."""
    out: dict[str, str] = {}
    for pair in (p.strip() for p in value.split(",")):
        if not pair:
            continue
        domain, sep, tenant = (part.strip() for part in pair.partition("="))
        if not sep or not domain or "@" in domain or not tenant:
            raise ValueError(f"use domain=tenant pairs separated by commas, got {pair!r}")
        out[domain.lower()] = tenant
    return out


class SettingsError(RuntimeError):
    """A ``TANDEM_`` variable is missing, malformed or unknown."""


class CommonSettings(BaseSettings):
    """Settings every process of the stack reads."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore")

    home: Path = Path(".tandem")
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Port of the embedded Valkey server that `tandem up` starts when TANDEM_REDIS_URL is unset.
    redis_port: int = 6379
    device: DeviceName = "auto"
    # Colon-separated folders that server-side model, adapter and dataset paths must lie in.
    model_roots: str = ""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_json: bool = True
    host: str = "127.0.0.1"
    agent_port: int = DEFAULT_PORTS["agent"]
    inference_port: int = DEFAULT_PORTS["inference"]
    retrieval_port: int = DEFAULT_PORTS["retrieval"]
    trainer_port: int = DEFAULT_PORTS["trainer"]
    # Base URLs the services use to reach each other; empty means http://<host>:<port>.
    inference_url: str = ""
    retrieval_url: str = ""
    trainer_url: str = ""
    agent_url: str = ""
    inference_urls: str = Field(
        "",
        description="Comma-separated base URLs of several inference replicas: the agent, trainer and "
        "CLI spread requests over the ready ones (by /readyz) and retry a request once on another when "
        "one dies before answering. When set, it is used instead of TANDEM_INFERENCE_URL.",
    )
    # API key a service presents when it calls another service on its own behalf.
    service_api_key: str = ""
    max_upload_mb: int = 50
    # Largest request body of a route without its own limit (uploads have theirs), in MiB:
    # larger is a 413 before the body is read.
    max_body_mb: int = Field(16, ge=1)
    # Serve /docs and /openapi.json without an API key (with a key they are always served).
    public_docs: bool = False
    audit_retention_days: int = Field(
        365, ge=1, le=3650, description="Days the audit log keeps an entry (GET /v1/audit on the agent)."
    )
    audit_max_entries: int = Field(
        1_000_000,
        ge=1000,
        le=100_000_000,
        description="Most entries one tenant's audit log holds; past it the oldest are dropped first.",
    )
    # OpenID Connect: shared by every service, because the agent passes a caller's bearer JWT on
    # to the others, which check it themselves.
    oidc_issuer: str = Field(
        "",
        description="Issuer URL of the organisation's OpenID provider (its /.well-known/openid-configuration "
        "is read from there); empty: no sign-in with a provider, only keys and personal tokens.",
    )
    oidc_client_id: str = Field("", description="Client id Tandem has at the OpenID provider.")
    oidc_client_secret: str = Field(
        "", description="Client secret at the OpenID provider (empty: a public client, PKCE only)."
    )
    oidc_redirect_url: str = Field(
        "",
        description="Callback URL registered at the provider (…/v1/auth/oidc/callback on the agent); "
        "empty: derived from the request (set it behind a proxy that rewrites the host or scheme).",
    )
    oidc_scopes: str = Field("openid email profile", description="Scopes asked of the provider at sign-in.")
    oidc_audience: str = Field(
        "", description="Audience a bearer JWT from the provider must carry (empty: the client id)."
    )
    oidc_tenant_claim: str = Field(
        "", description="Claim naming a user's tenant (e.g. tenant); tried before TANDEM_OIDC_TENANT_DOMAINS."
    )
    oidc_tenant_domains: str = Field(
        "",
        description="Tenant of each email domain, comma-separated: example.com=acme,example.org=beta. "
        "A user whose claim and domain map to no tenant is refused.",
    )
    oidc_groups_claim: str = Field(
        "groups", description="Claim holding a user's groups (refreshed at every sign-in)."
    )
    oidc_default_role: Literal["admin", "member", "viewer"] = Field(
        "member", description="Role of a user created at its first sign-in."
    )
    oidc_name: str = Field(
        "", description="Name of the provider on the sign-in button (empty: the issuer's host)."
    )
    session_ttl_s: int = Field(
        43_200,
        ge=60,
        le=30 * 86_400,
        description="Seconds a web sign-in lasts (the session cookie and the token behind it).",
    )

    # Longest wait, in seconds, before `tandem up`'s supervisor restarts a component that keeps
    # exiting (the wait doubles from 1 s while it dies within a minute of starting).
    supervise_backoff_max_s: float = Field(30.0, ge=0)
    # Password of the Redis server when TANDEM_REDIS_URL carries none (compose sets it).
    redis_password: str = ""

    @field_validator("oidc_issuer", "oidc_redirect_url")
    @classmethod
    def _oidc_url(cls, value: str) -> str:
        if value and not value.startswith(("http://", "https://")):
            raise ValueError(f"must be an http:// or https:// URL, got {value!r}")
        # kept as given: an ID token's ``iss`` must equal the issuer exactly (OpenID Connect Core 3.1.3.7)
        return value

    @field_validator("oidc_tenant_domains")
    @classmethod
    def _tenant_domains(cls, value: str) -> str:
        tenant_domains(value)
        return value

    @model_validator(mode="after")
    def _oidc_client(self) -> CommonSettings:
        if self.oidc_issuer and not self.oidc_client_id:
            raise ValueError("TANDEM_OIDC_ISSUER is set, so TANDEM_OIDC_CLIENT_ID must be too")
        return self

    @property
    def oidc_tenant_domain_map(self) -> dict[str, str]:
        return tenant_domains(self.oidc_tenant_domains)

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"must start with redis://, rediss:// or unix://, got {value!r}")
        return value

    @model_validator(mode="after")
    def _redis_password_in_url(self) -> CommonSettings:
        # Every client (Celery's included) is built from redis_url: put the password there once.
        if self.redis_password:
            given = self.redis_url_given
            self.redis_url = with_password(self.redis_url, self.redis_password)
            if not given:  # the default with a password is still the default: see redis_url_given
                self.model_fields_set.discard("redis_url")
        return self

    @property
    def redis_url_given(self) -> bool:
        """Whether TANDEM_REDIS_URL (or the caller) named a Redis: without one, `tandem up`
        starts its embedded Valkey."""
        return "redis_url" in self.model_fields_set

    @field_validator("inference_urls")
    @classmethod
    def _replica_urls(cls, value: str) -> str:
        for url in (u.strip() for u in value.split(",")):
            if url and not url.startswith(("http://", "https://")):
                raise ValueError(f"must be http:// or https:// URLs separated by commas, got {url!r}")
        return value

    @field_validator("agent_port", "inference_port", "retrieval_port", "trainer_port", "redis_port")
    @classmethod
    def _port_range(cls, value: int) -> int:
        if not 1 <= value <= 65535:
            raise ValueError(f"must be a TCP port between 1 and 65535, got {value}")
        return value

    @property
    def home_dir(self) -> Path:
        return self.home.expanduser().resolve()

    @property
    def allowed_model_roots(self) -> list[Path]:
        if self.model_roots.strip():
            return [Path(p).expanduser().resolve() for p in self.model_roots.split(":") if p.strip()]
        return [self.home_dir / "models"]

    def port_of(self, service: str) -> int:
        return int(getattr(self, f"{service}_port"))

    def inference_replicas(self) -> list[str]:
        """TANDEM_INFERENCE_URLS when set, else the one inference URL."""
        urls = [u.strip().rstrip("/") for u in self.inference_urls.split(",") if u.strip()]
        return urls or [self.url_of("inference")]

    def url_of(self, service: str) -> str:
        explicit = str(getattr(self, f"{service}_url"))
        if explicit:
            return explicit.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port_of(service)}"


class ServiceSettings(BaseSettings):
    """Base of a service's own settings; subclasses set ``env_prefix`` to ``TANDEM_<SERVICE>_``."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore")


class TenantQuotaSettings(ServiceSettings):
    """The storage quota of a service that keeps tenants' files (``TANDEM_<SERVICE>_TENANT_QUOTA_MB``)."""

    tenant_quota_mb: int = Field(
        10240,
        ge=0,
        description="Disk space (MiB) one tenant's stored files (retrieval: its collections; trainer: its "
        "uploaded datasets) may use; an upload that would pass it is refused with 507. 0: no quota.",
    )


S = TypeVar("S", bound=BaseSettings)


def env_names(cls: type[BaseSettings]) -> set[str]:
    prefix = str(cls.model_config.get("env_prefix", ""))
    return {f"{prefix}{name}".upper() for name in cls.model_fields}


def _describe(cls: type[BaseSettings], exc: ValidationError) -> str:
    prefix = str(cls.model_config.get("env_prefix", ""))
    lines = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else "?"
        var = f"{prefix}{field}".upper()
        got = os.environ.get(var)
        shown = f" (got {got!r})" if got is not None else ""
        lines.append(f"{var}: {err['msg']}{shown}")
    return "invalid settings:\n  " + "\n  ".join(lines)


def check_unknown_env(*classes: type[BaseSettings], environ: dict[str, str] | None = None) -> None:
    """Refuse ``TANDEM_`` variables that none of ``classes`` (nor another service) reads.

    A misspelt variable would otherwise be ignored silently.
    Variables of services not in ``classes`` are left to those services to check.
    """
    env = os.environ if environ is None else environ
    known = env_names(CommonSettings)
    own_prefixes = set()
    for cls in classes:
        known |= env_names(cls)
        own_prefixes.add(str(cls.model_config.get("env_prefix", "")).upper())
    other_prefixes = {f"TANDEM_{s.upper()}_" for s in SERVICE_NAMES} - own_prefixes
    unknown = [
        name
        for name in env
        if name.startswith("TANDEM_")
        and name not in known
        and not any(name.startswith(p) for p in other_prefixes)
        and not name.startswith("TANDEM_TEST_")
    ]
    if unknown:
        raise SettingsError(
            "unknown setting(s): " + ", ".join(sorted(unknown)) + " (see .env.example for every variable)"
        )


def load_settings(cls: type[S], *, check_unknown: bool = True) -> S:
    """Build ``cls`` from the environment, turning validation errors into a SettingsError."""
    try:
        settings = cls()
    except ValidationError as exc:
        raise SettingsError(_describe(cls, exc)) from None
    if check_unknown:
        check_unknown_env(cls)
    return settings


def load_common() -> CommonSettings:
    """The common settings from the environment (the ``TANDEM_`` variables every service reads)."""
    return load_settings(CommonSettings, check_unknown=False)
