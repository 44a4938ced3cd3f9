"""A real OpenID provider for tests: npm's ``oidc-provider`` (tests/oidc/provider.mjs) in a node
process, and a client that signs a person in through its login and consent pages over HTTP.

``npm ci`` installs the pinned provider into tests/oidc/node_modules the first time (``make
test`` does it too); without node and npm the tests that need it are skipped, saying so.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urljoin, urlsplit

import httpx
import pytest
from bs4 import BeautifulSoup

from tests.helpers.servers import REPO_ROOT, free_port, stop_process
from tests.helpers.waiting import wait_until

OIDC_DIR = REPO_ROOT / "tests" / "oidc"
TEST_CACHE = REPO_ROOT / ".cache" / "tests"
PROVIDER_SCRIPT = OIDC_DIR / "provider.mjs"


def ensure_provider_installed() -> None:
    """tests/oidc/node_modules from package-lock.json (once; a lock file keeps two runs apart)."""
    if (OIDC_DIR / "node_modules" / "oidc-provider" / "package.json").exists():
        return
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip(
            "node and npm are needed for the test OpenID provider (Debian: apt-get install nodejs npm)"
        )
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    with open(TEST_CACHE / "oidc-npm-ci.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (OIDC_DIR / "node_modules" / "oidc-provider" / "package.json").exists():
            subprocess.run(
                ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=OIDC_DIR, check=True
            )


@dataclass
class ProviderProcess:
    issuer: str
    config_path: Path
    config: dict[str, Any] = field(default_factory=dict)

    def endpoint(self, name: str) -> str:
        """An endpoint from the provider's discovery document (``authorization``, ``token``, ...)."""
        doc = httpx.get(f"{self.issuer}/.well-known/openid-configuration", timeout=10).json()
        return str(doc[f"{name}_endpoint"])

    def set_account(self, login: str, claims: dict[str, Any]) -> None:
        """Adds or changes a person (read by the provider at the next sign-in)."""
        self.config["accounts"][login] = claims
        self.config_path.write_text(json.dumps(self.config))


@contextmanager
def oidc_provider(
    workdir: Path,
    clients: list[dict[str, Any]],
    accounts: dict[str, dict[str, Any]],
    *,
    port: int | None = None,
    id_token_ttl: int = 3600,
) -> Iterator[ProviderProcess]:
    """The provider at ``http://localhost:<port>`` (another site than the 127.0.0.1 of the test
    servers, as a real provider is); ``clients`` are oidc-provider client metadata."""
    ensure_provider_installed()
    port = port or free_port()
    issuer = f"http://localhost:{port}"
    config = {
        "issuer": issuer,
        "port": port,
        "clients": clients,
        "accounts": accounts,
        "idTokenTtl": id_token_ttl,
    }
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "provider.json"
    path.write_text(json.dumps(config))
    log = workdir / "provider.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["node", str(PROVIDER_SCRIPT), str(path)], cwd=OIDC_DIR, stdout=out, stderr=subprocess.STDOUT
        )
    try:

        def discovered() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"the OpenID provider exited: {log.read_text()[-2000:]}")
            try:
                return httpx.get(f"{issuer}/.well-known/openid-configuration", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(discovered, 60, "the test OpenID provider answers discovery", interval=0.1, log=log)
        yield ProviderProcess(issuer, path, config)
    finally:
        stop_process(proc, timeout=10)


def through_provider(client: httpx.Client, resp: httpx.Response, login: str, stop_at: str) -> str:
    """Follows ``resp``'s redirects through the provider's login (``login``, any password) and
    consent pages until one leads to a URL starting with ``stop_at``; returns that URL."""
    for _ in range(20):
        if resp.is_redirect:
            location = urljoin(str(resp.url), resp.headers["location"])
            if location.startswith(stop_at):
                return location
            resp = client.get(location)
            continue
        assert resp.status_code == 200, resp.text[:2000]
        form = BeautifulSoup(resp.text, "html.parser").find("form")
        assert form is not None, resp.text[:2000]
        fields = {i["name"]: i.get("value", "") for i in form.find_all("input") if i.get("name")}
        if "login" in fields:
            fields.update(login=login, password="any password")
        resp = client.post(urljoin(str(resp.url), str(form["action"])), data=fields)
    raise AssertionError(f"no redirect to {stop_at} after 20 steps")


def provider_tokens(
    provider: ProviderProcess, client_id: str, secret: str, redirect_uri: str, login: str, scope: str
) -> dict[str, Any]:
    """Tokens the provider issues to ``client_id`` for ``login``: the code flow with PKCE driven
    here (Tandem plays no part), as any other application of the organisation would get them."""
    verifier = secrets.token_urlsafe(48)
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
    params = {
        "response_type": "code",
        "client_id": client_id,
        "redirect_uri": redirect_uri,
        "scope": scope,
        "state": secrets.token_urlsafe(8),
        "nonce": secrets.token_urlsafe(8),
        "code_challenge": challenge,
        "code_challenge_method": "S256",
    }
    with httpx.Client(timeout=30) as client:
        start = client.get(provider.endpoint("authorization"), params=params)
        back = through_provider(client, start, login, redirect_uri)
        code = parse_qs(urlsplit(back).query)["code"][0]
        resp = client.post(
            provider.endpoint("token"),
            data={
                "grant_type": "authorization_code",
                "code": code,
                "redirect_uri": redirect_uri,
                "code_verifier": verifier,
            },
            auth=(client_id, secret),
        )
    assert resp.status_code == 200, resp.text
    tokens: dict[str, Any] = resp.json()
    return tokens
