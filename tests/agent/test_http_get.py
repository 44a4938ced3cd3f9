import httpx
import pytest

from services.agent.tools.base import ToolContext
from services.agent.tools.http_get import HttpGet
from services.common.outbound import RefusedAddress, check_url, is_public

pytestmark = pytest.mark.anyio

PUBLIC = "93.184.216.34"


def resolver_of(table: dict[str, list[str]]):  # type: ignore[no-untyped-def]
    async def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise OSError(f"no such host {host}")
        return table[host]

    return resolve


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "::1",
        "fe80::1",
        "fc00::1",
        "0.0.0.0",
        "100.64.0.1",
        "::ffff:127.0.0.1",
        "224.0.0.1",
    ],
)
def test_private_loopback_link_local_are_not_public(address: str) -> None:
    assert not is_public(address)


def test_public_addresses() -> None:
    assert is_public(PUBLIC) and is_public("2606:4700::1111")


async def test_refused_after_dns_resolution() -> None:
    resolve = resolver_of(
        {
            "sneaky.example": [PUBLIC, "127.0.0.1"],
            "meta.example": ["169.254.169.254"],
            "127.0.0.1": ["127.0.0.1"],
            "::1": ["::1"],
        }
    )
    for url in (
        "http://sneaky.example/",
        "http://meta.example/latest",
        "http://127.0.0.1:8000/",
        "http://[::1]/",
    ):
        with pytest.raises(RefusedAddress, match="private, loopback or link-local"):
            await check_url(url, resolve)
    with pytest.raises(RefusedAddress, match="cannot resolve"):
        await check_url("http://nowhere.example/", resolve)
    with pytest.raises(RefusedAddress, match="only http and https"):
        await check_url("file:///etc/passwd", resolve)
    with pytest.raises(RefusedAddress, match="credentials"):
        await check_url(f"http://user:pw@{PUBLIC}/", resolve)


async def test_connects_to_the_checked_address_and_refuses_redirects_to_private() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/start":
            return httpx.Response(302, headers={"location": "http://internal.example/admin"})
        return httpx.Response(
            200, text="<html><body><p>Hello public</p></body></html>", headers={"content-type": "text/html"}
        )

    tool = HttpGet(
        resolver=resolver_of({"public.example": [PUBLIC], "internal.example": ["10.0.0.5"]}),
        transport=httpx.MockTransport(handler),
    )
    out = await tool.run("http://public.example/page", ToolContext())
    assert out == "HTTP 200: Hello public"
    # Pinned: the connection goes to the checked IP, the name rides in Host.
    assert seen[-1].url.host == PUBLIC and seen[-1].headers["host"] == "public.example"
    refused = await tool.run("http://public.example/start", ToolContext())
    assert refused.startswith("error: refused:") and "10.0.0.5" in refused
    assert all(r.url.host == PUBLIC for r in seen)  # the private hop was never contacted


async def test_body_size_is_capped() -> None:
    tool = HttpGet(
        max_bytes=2048,
        resolver=resolver_of({"big.example": [PUBLIC]}),
        transport=httpx.MockTransport(lambda r: httpx.Response(200, text="a" * 100_000)),
        max_chars=10**6,
    )
    assert len(await tool.run("http://big.example/", ToolContext())) == len("HTTP 200: ") + 2048
