"""HTTP GET for agents: off by default, and never towards private networks.

Every hop (the first URL and each redirect) is resolved with DNS, and refused
when any address it resolves to is loopback, private, link-local (cloud metadata
at 169.254.169.254), multicast, reserved or unspecified. The connection then goes
to the checked address itself (Host header and TLS SNI keep the name), so a DNS
answer that changes between check and connect (rebinding) cannot slip through.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from services.agent.tools.base import ToolContext, argument_text, single_string_schema

Resolver = Callable[[str, int], Awaitable[list[str]]]
MAX_REDIRECTS = 5


class RefusedAddress(ValueError):
    pass


async def system_resolver(host: str, port: int) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def is_public(address: str) -> bool:
    """True only for globally routable unicast addresses (``is_global`` already excludes private,
    loopback, link-local, reserved, unspecified and carrier-grade NAT ranges)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


async def check_url(url: str, resolver: Resolver) -> tuple[str, str]:
    """Returns (host, public address to connect to), or raises RefusedAddress."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise RefusedAddress(f"only http and https URLs are allowed, got {parts.scheme or 'none'!r}")
    host = parts.hostname
    if not host:
        raise RefusedAddress(f"URL {url!r} has no host")
    if parts.username or parts.password:
        raise RefusedAddress("URLs with credentials are not allowed")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        addresses = await resolver(host, port)
    except (OSError, UnicodeError) as exc:
        raise RefusedAddress(f"cannot resolve {host!r}: {exc}") from None
    if not addresses:
        raise RefusedAddress(f"{host!r} resolves to no address")
    for address in addresses:
        if not is_public(address):
            raise RefusedAddress(f"{host!r} resolves to {address}, a private, loopback or link-local address")
    return host, addresses[0]


@dataclass
class HttpGet:
    # not annotated: class attributes of the tool, not dataclass fields
    name = "http_get"
    description = "Fetches a public web page by URL and returns the start of its text. Input: the URL."
    parameters = single_string_schema("url", "an http(s) URL on the public internet")

    max_bytes: int = 200_000
    timeout: float = 10.0
    resolver: Resolver = system_resolver
    transport: httpx.AsyncBaseTransport | None = None
    max_chars: int = 2000

    async def fetch(self, url: str) -> httpx.Response:
        async with httpx.AsyncClient(
            timeout=self.timeout, follow_redirects=False, transport=self.transport
        ) as client:
            for _ in range(MAX_REDIRECTS + 1):
                host, address = await check_url(url, self.resolver)
                parts = urlsplit(url)
                netloc = f"[{address}]" if ":" in address else address
                if parts.port:
                    netloc += f":{parts.port}"
                pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
                request = client.build_request(
                    "GET",
                    pinned,
                    headers={"Host": parts.netloc.rpartition("@")[2], "User-Agent": "tandem-agent/0.1"},
                    extensions={"sni_hostname": host},
                )
                resp = await client.send(request, stream=True)
                try:
                    if resp.is_redirect and "location" in resp.headers:
                        url = urljoin(url, resp.headers["location"])
                        continue
                    body = b""
                    async for piece in resp.aiter_bytes():
                        body += piece
                        if len(body) >= self.max_bytes:
                            body = body[: self.max_bytes]
                            break
                    resp._content = body
                    return resp
                finally:
                    await resp.aclose()
        raise RefusedAddress(f"more than {MAX_REDIRECTS} redirects")

    async def run(self, argument: Any, ctx: ToolContext) -> str:
        url = argument_text(argument, "url").strip().strip("`'\"<>")
        try:
            resp = await self.fetch(url)
        except RefusedAddress as exc:
            return f"error: refused: {exc}"
        except httpx.HTTPError as exc:
            return f"error: {type(exc).__name__}: {exc}"
        text = resp.content.decode(resp.encoding or "utf-8", errors="replace")
        if "html" in resp.headers.get("content-type", ""):
            from bs4 import BeautifulSoup

            text = BeautifulSoup(text, "html.parser").get_text(" ", strip=True)
        return f"HTTP {resp.status_code}: {text[: self.max_chars]}"
