"""A real MCP server (the official SDK's server API) served over Streamable HTTP on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mcp.server.transport_security import TransportSecuritySettings

from tests.helpers.servers import serve_app


@contextmanager
def serve_mcp(server: Any) -> Iterator[str]:
    """``server`` (an ``MCPServer``) stateless with JSON answers; yields its endpoint URL. The
    DNS-rebinding check is off: clients reach it as 127.0.0.1 with a port, which it would refuse."""
    app = server.streamable_http_app(
        stateless_http=True,
        json_response=True,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
    )
    with serve_app(app) as url:
        yield f"{url}/mcp"
