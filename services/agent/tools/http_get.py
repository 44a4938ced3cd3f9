"""HTTP GET for agents: off by default, and never towards private networks.

Every hop (the first URL and each redirect) goes through the outbound guard
(services/common/outbound.py): the host is resolved when the connection is made and
refused when any address it resolves to is loopback, private, link-local (cloud
metadata at 169.254.169.254), multicast, reserved or unspecified, IPv6 forms that
carry such an IPv4 address included. The connection then goes to the checked address
itself (Host header and TLS SNI keep the name), so a DNS answer that changes between
check and connect (rebinding) cannot slip through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin

import httpx

from services.agent.tools.base import ToolContext, argument_text, single_string_schema
from services.common.outbound import GuardedTransport, RefusedAddress, Resolver, check_form, system_resolver

MAX_REDIRECTS = 5


@dataclass
class HttpGet:
    # not annotated: class attributes of the tool, not dataclass fields
    name = "http_get"
    description = "Fetches a public web page by URL and returns the start of its text. Input: the URL."
    parameters = single_string_schema("url", "an http(s) URL on the public internet")
    # a GET to a URL the model chose (maybe from an injected document) can leak what the run read
    side_effects = True
    needs = ("outbound",)  # offered only while outbound calls are on

    max_bytes: int = 200_000
    timeout: float = 10.0
    resolver: Resolver = system_resolver
    transport: httpx.AsyncBaseTransport | None = None
    max_chars: int = 2000

    async def fetch(self, url: str) -> httpx.Response:
        guarded = GuardedTransport(self.transport, resolver=self.resolver)
        async with httpx.AsyncClient(
            timeout=self.timeout,
            follow_redirects=False,  # followed here, so a redirect's body is capped too
            transport=guarded,
            headers={"User-Agent": "tandem-agent/0.1"},
        ) as client:
            for _ in range(MAX_REDIRECTS + 1):
                check_form(url)
                resp = await client.send(client.build_request("GET", url), stream=True)
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
