"""A tenant's registered MCP servers, and the MCP tools one agent run gets from them.

Redis layout (per tenant)::

    tandem:agent:mcp:<tenant> -> hash {server name -> JSON record}

A record holds the URL, the header values encrypted with Fernet (key: ``TANDEM_AGENT_MCP_SECRET_KEY``
or ``$TANDEM_HOME/agent/mcp-secret.key``), the agents the server's tools are enabled for, and
optionally which of its tools are. Header values never leave the service: records are listed with
the header names only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Annotated, Any, NotRequired, TypedDict

from cryptography.fernet import Fernet, InvalidToken
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from services.agent.config import AgentSettings
from services.agent.tools.base import Tool
from services.agent.tools.mcp import (
    McpEndpoint,
    McpFailed,
    McpLimits,
    McpTool,
    UnavailableServer,
    check_server_url,
    list_tools,
)
from services.common.atomic import atomic_write
from services.common.bounds import Name
from services.common.errors import Conflict, InvalidRequest, NotFound
from services.common.outbound import RefusedAddress

log = logging.getLogger("tandem.agent.mcp")
NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,31}$"
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$")
# Headers the client sets itself (or that would change the transport): a server's may not.
_RESERVED_HEADERS = frozenset(
    {"host", "content-length", "content-type", "accept", "connection", "transfer-encoding", "mcp-session-id"}
)


class McpServerCreate(BaseModel):
    """``POST /v1/mcp/servers``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        ..., max_length=32, pattern=NAME_PATTERN, description="1-32 lowercase letters, digits, '_' or '-'."
    )
    url: str = Field(..., min_length=1, max_length=2000, description="The server's Streamable HTTP endpoint.")
    headers: dict[Name, Annotated[str, Field(max_length=8192)]] | None = Field(
        None,
        max_length=32,
        description="At most 32, sent with every request (e.g. Authorization); stored encrypted, never returned.",
    )
    agents: list[Name] = Field(
        default_factory=list, max_length=50, description="Agents whose runs get this server's tools."
    )
    tools: list[Name] | None = Field(
        None, max_length=200, description="The server's tools agents get; null: all of them."
    )

    @field_validator("headers")
    @classmethod
    def _headers(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for name, header in (value or {}).items():
            if not _HEADER_NAME.match(name) or name.lower() in _RESERVED_HEADERS:
                raise ValueError(f"header name {name!r} is not allowed")
            if "\n" in header or "\r" in header or len(header) > 8192:
                raise ValueError(f"header {name!r}: the value has a line break or is longer than 8192")
        return value


class McpServerUpdate(BaseModel):
    """``PATCH /v1/mcp/servers/{name}``: which agents get the server's tools, and which tools."""

    model_config = ConfigDict(extra="forbid")

    agents: list[Name] | None = Field(None, max_length=50)
    tools: list[Name] | None = Field(None, max_length=200)
    all_tools: StrictBool = Field(False, description="true: every tool of the server (clears 'tools').")


class McpServerInfo(BaseModel):
    name: str
    url: str
    header_names: list[str]
    agents: list[str]
    tools: list[str] | None
    created_at: float


class McpServerList(BaseModel):
    """``GET /v1/mcp/servers``: the tenant's servers, oldest first."""

    data: list[McpServerInfo]


class StoredServer(TypedDict):
    """A registered server as kept in Redis: header values encrypted (Fernet)."""

    name: str
    url: str
    headers: NotRequired[dict[str, str]]
    agents: NotRequired[list[str]]
    tools: NotRequired[list[str] | None]  # None: every tool of the server
    created_at: NotRequired[float]


def load_cipher(settings: AgentSettings, home: Path) -> Fernet:
    """The Fernet of the setting's key, else of the key file in the home (created once, 0600)."""
    if settings.mcp_secret_key:
        try:
            return Fernet(settings.mcp_secret_key.encode())
        except ValueError as exc:
            raise ValueError(f"TANDEM_AGENT_MCP_SECRET_KEY is not a Fernet key: {exc}") from None
    path = home / "agent" / "mcp-secret.key"
    if not path.exists():
        atomic_write(path, Fernet.generate_key())
        os.chmod(path, 0o600)
    return Fernet(path.read_bytes().strip())


def _redis_key(tenant: str) -> str:
    return f"tandem:agent:mcp:{tenant}"


class McpServerStore:
    def __init__(self, redis: Any, cipher: Fernet, settings: AgentSettings) -> None:
        self.redis = redis
        self.cipher = cipher
        self.settings = settings

    def limits(self) -> McpLimits:
        return McpLimits(
            timeout_s=self.settings.mcp_timeout_s,
            max_response_bytes=self.settings.mcp_max_response_bytes,
            allow_private=self.settings.mcp_allow_private,
        )

    @staticmethod
    def _info(record: StoredServer) -> McpServerInfo:
        return McpServerInfo(
            name=record["name"],
            url=record["url"],
            header_names=sorted(record.get("headers", {})),
            agents=list(record.get("agents", [])),
            tools=record.get("tools"),
            created_at=float(record.get("created_at", 0)),
        )

    async def _record(self, tenant: str, name: str) -> StoredServer:
        raw = await self.redis.hget(_redis_key(tenant), name)
        if raw is None:
            raise NotFound(f"no MCP server {name!r}: register it with POST /v1/mcp/servers", param="name")
        record: StoredServer = json.loads(raw)
        return record

    async def check_url(self, url: str) -> None:
        """A 400 naming ``url`` for a URL that is not http(s), or that resolves to a private,
        loopback or link-local address (unless TANDEM_AGENT_MCP_ALLOW_PRIVATE)."""
        try:
            await check_server_url(url, self.settings.mcp_allow_private)
        except RefusedAddress as exc:
            hint = "" if self.settings.mcp_allow_private else " (an operator may allow private servers)"
            raise InvalidRequest(f"url: {exc}{hint}", param="url") from None

    async def add(self, tenant: str, body: McpServerCreate) -> McpServerInfo:
        await self.check_url(body.url)
        key = _redis_key(tenant)
        if await self.redis.hlen(key) >= self.settings.mcp_max_servers:
            raise Conflict(
                f"the tenant already has {self.settings.mcp_max_servers} MCP servers "
                "(TANDEM_AGENT_MCP_MAX_SERVERS): delete one first",
                param="name",
            )
        record: StoredServer = {
            "name": body.name,
            "url": body.url,
            "headers": {n: self.cipher.encrypt(v.encode()).decode() for n, v in (body.headers or {}).items()},
            "agents": list(dict.fromkeys(body.agents)),
            "tools": body.tools,
            "created_at": time.time(),
        }
        if not await self.redis.hsetnx(key, body.name, json.dumps(record)):
            raise Conflict(f"an MCP server named {body.name!r} is already registered", param="name")
        return self._info(record)

    async def servers(self, tenant: str) -> list[McpServerInfo]:
        raw = await self.redis.hgetall(_redis_key(tenant))
        return sorted((self._info(json.loads(v)) for v in raw.values()), key=lambda s: s.created_at)

    async def get(self, tenant: str, name: str) -> McpServerInfo:
        return self._info(await self._record(tenant, name))

    async def update(self, tenant: str, name: str, body: McpServerUpdate) -> McpServerInfo:
        record = await self._record(tenant, name)
        if body.agents is not None:
            record["agents"] = list(dict.fromkeys(body.agents))
        if body.all_tools:
            record["tools"] = None
        elif body.tools is not None:
            record["tools"] = list(dict.fromkeys(body.tools))
        await self.redis.hset(_redis_key(tenant), name, json.dumps(record))
        return self._info(record)

    async def delete(self, tenant: str, name: str) -> None:
        if not await self.redis.hdel(_redis_key(tenant), name):
            raise NotFound(f"no MCP server {name!r}", param="name")

    async def endpoint(self, tenant: str, name: str) -> McpEndpoint:
        record = await self._record(tenant, name)
        return self._endpoint(record)

    def _endpoint(self, record: StoredServer) -> McpEndpoint:
        headers: dict[str, str] = {}
        for header, token in record.get("headers", {}).items():
            try:
                headers[header] = self.cipher.decrypt(token.encode()).decode()
            except InvalidToken:
                raise McpFailed(
                    f"MCP server {record['name']!r}: its header {header!r} was stored with another "
                    "secret key (TANDEM_AGENT_MCP_SECRET_KEY): register the server again"
                ) from None
        return McpEndpoint(url=record["url"], headers=headers)

    async def agent_tools(
        self, tenant: str, agent: str, requested: list[str], named: list[str] | None = None
    ) -> dict[str, Tool]:
        """The MCP tools of one agent run: the servers the caller names (``mcp_servers``: each
        must be registered, else a 404 naming it), those registered with this agent enabled, and
        those the agent's definition names (``server`` or ``server/tool``). A server that cannot
        be listed gives a stand-in tool whose call is the error, so the run still goes on."""
        raw = await self.redis.hgetall(_redis_key(tenant))
        records: dict[str, StoredServer] = {k: json.loads(v) for k, v in raw.items()}
        for name in requested:
            if name not in records:
                raise NotFound(
                    f"mcp_servers: no MCP server {name!r} is registered for this key", param="mcp_servers"
                )
        wanted: dict[str, set[str] | None] = {}  # server -> tool names (None: all the record allows)

        def want(server: str, tool: str | None) -> None:
            current = wanted.get(server, set())
            if tool is None or server not in wanted:
                wanted[server] = None if tool is None else {tool}
            elif current is not None:
                current.add(tool)

        for name in requested:
            want(name, None)
        for name, record in records.items():
            if agent in record.get("agents", []):
                want(name, None)
        for entry in named or []:
            server, _, tool = entry.partition("/")
            if server in records:
                want(server, tool or None)
            else:
                log.info(
                    "agent %r names MCP server %r, which tenant %r has not registered", agent, server, tenant
                )
        limits = self.limits()

        async def listed(server: str) -> dict[str, Tool]:
            record = records[server]
            allowed, only = record.get("tools"), wanted[server]
            try:
                endpoint = self._endpoint(record)
                infos = await list_tools(endpoint, limits)
            except McpFailed as exc:
                stand_in = UnavailableServer.of(server, str(exc))
                return {stand_in.name: stand_in}
            out: dict[str, Tool] = {}
            for info in infos:
                if (allowed is not None and info.name not in allowed) or (
                    only is not None and info.name not in only
                ):
                    continue
                wrapped = McpTool.of(server, info, endpoint, limits)
                out[wrapped.name] = wrapped
            return out

        tools: dict[str, Tool] = {}
        for found in await asyncio.gather(*(listed(server) for server in wanted)):  # the servers at once
            tools.update(found)
        return tools
