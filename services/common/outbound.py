"""The address guard for calls to URLs that tenants, users or models name (MCP servers, the HTTP
GET tool, source connectors): such a call may reach the public internet, never the private
networks around the service (loopback, RFC 1918, link-local with cloud metadata at
169.254.169.254, carrier-grade NAT, multicast, reserved, unspecified).

Three parts, one judgement:

- ``is_public(address)``: whether one address may be contacted. IPv6 forms that carry an IPv4
  address are judged by the IPv4 inside (``ipaddress.is_global`` calls ``64:ff9b::7f00:1``, NAT64
  of 127.0.0.1, global);
- ``check_url(url, resolver)``: the URL's form (http or https, a host, no credentials) and every
  address its host resolves to;
- ``GuardedTransport`` (httpx) and ``GuardedTransport2`` (``httpx2``, the client of the ``mcp``
  SDK): the check again at connect time, for every request and every redirect hop, after which
  the connection goes to the checked address itself (the ``Host`` header and TLS SNI keep the
  name). A name that resolved to a public address when it was registered and resolves to a
  private one now (DNS rebinding) is refused, and no second lookup happens between the check and
  the connect.

``allow_private`` (an operator's setting, such as ``TANDEM_AGENT_MCP_ALLOW_PRIVATE``) skips the
address judgement and the pinning; the URL's form is still checked.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import httpx2

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``(host, port) -> addresses``: ``system_resolver``, or a test's table."""

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_V4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # RFC 4291 2.5.5.1, deprecated: ::a.b.c.d
_NAT64_WELL_KNOWN = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052: IPv4 in the last 32 bits
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")  # RFC 8215 local-use prefix

REFUSED_KIND = "a private, loopback or link-local address"


class RefusedAddress(ValueError):
    """A URL the guard will not let a call go to: its form, or the address its host names."""


async def system_resolver(host: str, port: int) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address] | None:
    """The IPv4 addresses an IPv6 address stands for (a host behind a translator or tunnel
    reaches them), or None when it is not such a form."""
    if ip.ipv4_mapped is not None:
        return [ip.ipv4_mapped]
    last32 = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip in _V4_COMPATIBLE or ip in _NAT64_WELL_KNOWN:
        return [last32]
    if ip.sixtofour is not None:  # 2002::/16, RFC 3056: the IPv4 in bits 16-47
        return [ip.sixtofour]
    if ip.teredo is not None:  # 2001::/32, RFC 4380: the server IPv4 in bits 32-63
        server, client = ip.teredo  # the client's, in the last 32 bits, is stored bit-inverted
        return [server, client]
    return None


def _ipv4_public(ip: ipaddress.IPv4Address) -> bool:
    # is_global already excludes private, loopback, link-local, reserved, unspecified and
    # 100.64.0.0/10; multicast counts as global, and is no server.
    return ip.is_global and not ip.is_multicast


def is_public(address: str) -> bool:
    """True only for a globally routable unicast address (an IPv4 one inside IPv6 included)."""
    ip: IPAddress = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv4Address):
        return _ipv4_public(ip)
    if ip in _NAT64_LOCAL:
        # Refused whole rather than decoded (RFC 6052 would place the IPv4 in bits 48-63 and
        # 72-87): the prefix is for an operator's own translators, never the public internet.
        return False
    inside = embedded_ipv4(ip)
    if inside is not None:
        return all(_ipv4_public(v4) for v4 in inside)
    return ip.is_global and not ip.is_multicast and not ip.is_reserved


def _carrying(address: str) -> str:
    ip = ipaddress.ip_address(address.split("%")[0])
    inside = embedded_ipv4(ip) if isinstance(ip, ipaddress.IPv6Address) else None
    return f" (carrying {', '.join(map(str, inside))})" if inside else ""


def _ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None


@dataclass(frozen=True)
class Target:
    """What a URL asks to connect to."""

    scheme: str
    host: str
    port: int


def _target(scheme: str, host: str | None, port: int | None, credentials: bool, url: str) -> Target:
    if scheme not in ("http", "https"):
        raise RefusedAddress(f"only http and https URLs are allowed, got {scheme or 'none'!r}")
    if not host:
        raise RefusedAddress(f"URL {url!r} has no host")
    if credentials:
        raise RefusedAddress("URLs with credentials are not allowed")
    return Target(scheme, host, port or (443 if scheme == "https" else 80))


def check_form(url: str) -> Target:
    """The URL's scheme (http or https), host and port, or RefusedAddress; no lookup."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a malformed host or port
    except ValueError as exc:
        raise RefusedAddress(f"not a valid URL: {exc}") from None
    return _target(parts.scheme, parts.hostname, port, bool(parts.username or parts.password), url)


async def check_host(
    host: str, port: int, resolver: Resolver = system_resolver, *, allow_private: bool = False
) -> str:
    """The address to connect to for ``host``: its first, when every address it resolves to is
    public (or ``allow_private``); else RefusedAddress naming the address."""
    literal = _ip_literal(host)
    if literal is not None:
        addresses = [str(literal)]
    else:
        try:
            addresses = await resolver(host, port)
        except (OSError, UnicodeError) as exc:
            raise RefusedAddress(f"cannot resolve {host!r}: {exc}") from None
        if not addresses:
            raise RefusedAddress(f"{host!r} resolves to no address")
    if not allow_private:
        for address in addresses:
            if not is_public(address):
                raise RefusedAddress(f"{host!r} resolves to {address}{_carrying(address)}, {REFUSED_KIND}")
    return addresses[0]


async def check_url(
    url: str, resolver: Resolver = system_resolver, *, allow_private: bool = False
) -> tuple[str, str]:
    """``(host, address to connect to)`` for a URL of the right form whose host resolves only to
    public addresses; else RefusedAddress. With ``allow_private`` only the form is checked (the
    address is then the host itself)."""
    target = check_form(url)
    if allow_private:
        return target.host, target.host
    return target.host, await check_host(target.host, target.port, resolver)


async def _pinned_host(
    scheme: str, host: str, port: int | None, credentials: bool, url: str, resolver: Resolver
) -> str | None:
    """The checked address a request must connect to instead of its host, or None when the
    host already is that address."""
    target = _target(scheme, host, port, credentials, url)
    address = await check_host(target.host, target.port, resolver)
    return None if address == target.host else address


class GuardedTransport(httpx.AsyncBaseTransport):
    """An httpx transport that checks each request's host when it connects and connects to the
    checked address; ``inner`` (default ``httpx.AsyncHTTPTransport()``) makes the connection."""

    def __init__(
        self,
        inner: httpx.AsyncBaseTransport | None = None,
        *,
        resolver: Resolver = system_resolver,
        allow_private: bool = False,
    ) -> None:
        self.inner = inner or httpx.AsyncHTTPTransport()
        self.resolver = resolver
        self.allow_private = allow_private

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if self.allow_private:
            check_form(str(url))
            return await self.inner.handle_async_request(request)
        address = await _pinned_host(
            url.scheme, url.host, url.port, bool(url.userinfo), str(url), self.resolver
        )
        if address is None:
            return await self.inner.handle_async_request(request)
        # A new request, so the client's own (redirects, response.request) keeps the name.
        pinned = httpx.Request(
            request.method,
            url.copy_with(host=address),
            headers=request.headers,  # Host: the name, as the client set it
            stream=request.stream,
            extensions={**request.extensions, "sni_hostname": url.host},
        )
        return await self.inner.handle_async_request(pinned)

    async def aclose(self) -> None:
        await self.inner.aclose()


class GuardedTransport2(httpx2.AsyncBaseTransport):
    """``GuardedTransport`` for ``httpx2`` clients (the ``mcp`` SDK's)."""

    def __init__(
        self,
        inner: httpx2.AsyncBaseTransport | None = None,
        *,
        resolver: Resolver = system_resolver,
        allow_private: bool = False,
    ) -> None:
        self.inner = inner or httpx2.AsyncHTTPTransport()
        self.resolver = resolver
        self.allow_private = allow_private

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        url = request.url
        if self.allow_private:
            check_form(str(url))
            return await self.inner.handle_async_request(request)
        address = await _pinned_host(
            url.scheme, url.host, url.port, bool(url.userinfo), str(url), self.resolver
        )
        if address is None:
            return await self.inner.handle_async_request(request)
        pinned = httpx2.Request(
            request.method,
            url.copy_with(host=address),
            headers=request.headers,
            stream=request.stream,
            extensions={**request.extensions, "sni_hostname": url.host},
        )
        return await self.inner.handle_async_request(pinned)

    async def aclose(self) -> None:
        await self.inner.aclose()
