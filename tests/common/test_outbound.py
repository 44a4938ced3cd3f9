"""The outbound address guard: IPv6 forms that carry a private IPv4 address, DNS rebinding between
the check and the connect, redirects to private addresses, and the operator's allow_private, over
real HTTP servers on 127.0.0.1 (a fake public address is routed to them by a NAT-like transport)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography.fernet import Fernet
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from services.agent.config import AgentSettings
from services.agent.mcp_servers import McpServerCreate, McpServerStore
from services.agent.tools.base import ToolContext
from services.agent.tools.http_get import HttpGet
from services.agent.tools.mcp import McpEndpoint, McpFailed, McpLimits, check_server_url, list_tools
from services.common.errors import InvalidRequest
from services.common.outbound import GuardedTransport, RefusedAddress, Resolver, check_url, is_public
from services.common.redis_conn import async_redis
from tests.agent.test_mcp_client import mcp_server
from tests.helpers.servers import serve_app

pytestmark = pytest.mark.anyio

PUBLIC = "93.184.216.34"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def table(entries: dict[str, list[str]]) -> Resolver:
    async def resolve(host: str, port: int) -> list[str]:
        if host not in entries:
            raise OSError(f"no such host {host}")
        return entries[host]

    return resolve


# -- IPv6 forms that carry an IPv4 address -----------------------------------------------------

PROBES = {
    "http://[::127.0.0.1]/mcp": "127.0.0.1",  # v4-compatible
    "http://[64:ff9b::7f00:1]/mcp": "127.0.0.1",  # NAT64 of loopback
    "http://[64:ff9b::a00:1]/mcp": "10.0.0.1",  # NAT64 of RFC 1918
    "http://[2002:7f00:1::]/mcp": "127.0.0.1",  # 6to4 of loopback
}


@pytest.mark.parametrize("url", sorted(PROBES))
async def test_ipv6_forms_of_private_ipv4_are_refused_at_registration(
    url: str, redis_url: str, tmp_path: Path
) -> None:
    settings = AgentSettings()
    assert not settings.mcp_allow_private
    redis = async_redis(redis_url)
    store = McpServerStore(redis, Fernet(Fernet.generate_key()), settings)
    with pytest.raises(InvalidRequest, match=rf"carrying {PROBES[url]}\), a private") as refused:
        await store.add("outbound-probe", McpServerCreate(name="probe", url=url))
    assert refused.value.param == "url"
    assert await redis.hlen("tandem:agent:mcp:outbound-probe") == 0
    await redis.aclose()


@pytest.mark.parametrize(
    "address",
    [
        "::ffff:10.0.0.1",  # v4-mapped
        "::ffff:0:7f00:1",  # IPv4-translated (reserved)
        "::1",  # v4-compatible range: 0.0.0.1
        "::",
        "64:ff9b::a9fe:a9fe",  # NAT64 of the cloud metadata address
        "64:ff9b:1::808:808",  # local-use NAT64 prefix: refused whatever it carries
        "2002:a9fe:a9fe::1",  # 6to4 of 169.254.169.254
        "2001:0:a00:1::f7f7:f7f7",  # Teredo whose server is 10.0.0.1
        "2001:0:4136:e378:8000:63bf:80ff:fffe",  # Teredo whose client is NOT(80ff:fffe) = 127.0.0.1
        "ff0e::1",  # global-scope multicast
        "224.0.0.1",
        "240.0.0.1",  # reserved
        "0.0.0.0",
        "100.64.0.1",
    ],
)
async def test_private_multicast_reserved_and_unspecified_are_refused(address: str) -> None:
    assert not is_public(address)
    literal = f"[{address}]" if ":" in address else address
    with pytest.raises(RefusedAddress, match="a private, loopback or link-local address"):
        await check_server_url(f"http://{literal}/mcp", allow_private=False)


@pytest.mark.parametrize(
    "address",
    [
        "::ffff:8.8.8.8",  # v4-mapped
        "64:ff9b::808:808",  # NAT64
        "2002:808:808::1",  # 6to4
        "2001:0:4136:e378:8000:63bf:f7f7:f7f7",  # Teredo: server 65.54.227.120, client 8.8.8.8
        "2606:4700::1111",
    ],
)
async def test_forms_of_public_addresses_are_allowed(address: str) -> None:
    assert is_public(address)
    await check_server_url(f"http://[{address}]/mcp", allow_private=False)
    host, connect_to = await check_url(f"https://[{address}]/")
    assert ipaddress.ip_address(host) == ipaddress.ip_address(connect_to) == ipaddress.ip_address(address)


# -- DNS rebinding -----------------------------------------------------------------------------


class Flipping:
    """A resolver that answers ``first`` for its first ``times`` lookups, then ``later``."""

    def __init__(self, first: str, later: str, times: int = 1) -> None:
        self.first, self.later, self.times = first, later, times
        self.lookups = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.lookups += 1
        return [self.first if self.lookups <= self.times else self.later]


async def test_the_transport_connects_to_the_address_it_checked() -> None:
    reached: list[httpx.Request] = []

    def network(request: httpx.Request) -> httpx.Response:
        reached.append(request)
        return httpx.Response(200, text="ok")

    resolver = Flipping(PUBLIC, "127.0.0.1")
    guarded = GuardedTransport(httpx.MockTransport(network), resolver=resolver)
    async with httpx.AsyncClient(transport=guarded) as client:
        resp = await client.get("https://api.rebind.test/v1")
        assert resp.status_code == 200 and resp.request.url.host == "api.rebind.test"
        # one lookup, and the connection to its answer: no second lookup to rebind
        assert resolver.lookups == 1
        [sent] = reached
        assert sent.url.host == PUBLIC and sent.url.scheme == "https"
        assert sent.headers["host"] == "api.rebind.test"
        assert sent.extensions["sni_hostname"] == "api.rebind.test"
        # the name now answers loopback: refused before any connection
        with pytest.raises(RefusedAddress, match=r"127\.0\.0\.1, a private"):
            await client.get("https://api.rebind.test/v1")
    assert len(reached) == 1


async def test_an_mcp_server_name_rebound_to_loopback_is_refused_at_connect() -> None:
    """Public when registered and when checked before the call, loopback when the transport
    connects: the real server on 127.0.0.1 is never reached."""
    with mcp_server() as (url, log):
        port = httpx.URL(url).port
        endpoint = McpEndpoint(f"http://mcp.rebind.test:{port}/mcp")
        resolver = Flipping(PUBLIC, "127.0.0.1", times=2)
        await check_server_url(endpoint.url, allow_private=False, resolver=resolver)  # registration
        with pytest.raises(McpFailed, match=r"refused MCP server URL: .*127\.0\.0\.1, a private"):
            await list_tools(endpoint, McpLimits(timeout_s=5.0, resolver=resolver))
        assert resolver.lookups == 3  # registration, the call's check, the connect
        assert log.seen == []


# -- redirects and allow_private, over real HTTP -----------------------------------------------


class Nat(httpx.AsyncBaseTransport):
    """Routes PUBLIC to 127.0.0.1 (where the test's server listens), as a NAT would."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == PUBLIC:
            request.url = request.url.copy_with(host="127.0.0.1")
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


class Site:
    """A real HTTP server: ``/start`` redirects to ``/secret`` under the host named by ``to``."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.port = 0

        async def start(request: Request) -> Response:
            self.seen.append((request.url.path, request.headers["host"]))
            return RedirectResponse(f"http://{request.query_params['to']}:{self.port}/secret", 302)

        async def secret(request: Request) -> Response:
            self.seen.append((request.url.path, request.headers["host"]))
            return PlainTextResponse("the secret")

        self.app = Starlette(routes=[Route("/start", start), Route("/secret", secret)])


@pytest.fixture
def site() -> Iterator[Site]:
    served = Site()
    with serve_app(served.app) as url:
        served.port = httpx.URL(url).port or 0
        yield served


NAMES = table({"public.test": [PUBLIC], "internal.test": ["127.0.0.1"]})


@pytest.mark.parametrize("to", ["internal.test", "127.0.0.1"])
async def test_a_redirect_to_a_private_address_is_refused(site: Site, to: str) -> None:
    start = f"http://public.test:{site.port}/start?to={to}"
    out = await HttpGet(resolver=NAMES, transport=Nat()).run(start, ToolContext())
    assert out.startswith("error: refused:") and "127.0.0.1, a private" in out
    # the first hop reached the server under its name; the private hop never did
    assert site.seen == [("/start", f"public.test:{site.port}")]

    guarded = GuardedTransport(Nat(), resolver=NAMES)
    async with httpx.AsyncClient(transport=guarded, follow_redirects=True) as client:
        with pytest.raises(RefusedAddress, match=r"127\.0\.0\.1, a private"):
            await client.get(start)
    assert [path for path, _ in site.seen] == ["/start", "/start"]


async def test_allow_private_lets_a_local_server_through(site: Site) -> None:
    start = f"http://127.0.0.1:{site.port}/start?to=127.0.0.1"
    async with httpx.AsyncClient(transport=GuardedTransport(), follow_redirects=True) as client:
        with pytest.raises(RefusedAddress):
            await client.get(start)
    assert site.seen == []
    async with httpx.AsyncClient(
        transport=GuardedTransport(allow_private=True), follow_redirects=True
    ) as client:
        resp = await client.get(start)
    assert resp.status_code == 200 and resp.text == "the secret"
    assert [path for path, _ in site.seen] == ["/start", "/secret"]


async def test_allow_private_lets_an_mcp_server_on_loopback_through() -> None:
    with mcp_server() as (url, log):
        endpoint = McpEndpoint(url)
        with pytest.raises(McpFailed, match="refused MCP server URL"):
            await list_tools(endpoint, McpLimits(timeout_s=5.0))
        assert log.seen == []
        tools = await list_tools(endpoint, McpLimits(timeout_s=5.0, allow_private=True))
        assert "lookup_capital" in {t.name for t in tools}
        assert log.seen != []
