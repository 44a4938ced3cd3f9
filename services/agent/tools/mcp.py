"""MCP servers as agent tools, over the official SDK's client (``mcp.Client`` on Streamable HTTP).

The function API (``list_tools``, ``call_tool``) is what agents and any other caller use; each
call connects, does its one request and disconnects, within ``McpLimits``: a time limit on the
whole exchange, a cap on the bytes the server may answer, and the outbound address guard
(services/common/outbound.py) unless the operator allows private servers: on the URL at
registration and before each call, and in the transport at every connection, which goes to the
address just checked (so a server name rebound to a private address is refused).
Whatever goes wrong (unreachable, slow, too large, a protocol error) is an ``McpFailed`` naming
the server; a tool's own error result is ``McpResult.is_error``.

``McpTool`` wraps one server tool as an agent tool: its JSON schema made closed and bounded
(``constrained_schema``) so the engine's grammar keeps even a small model's call valid; a tool the
server does not mark read-only (``readOnlyHint``) counts as having side effects.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from services.agent.tools.base import ToolContext
from services.common.outbound import (
    GuardedTransport2,
    RefusedAddress,
    Resolver,
    check_url,
    system_resolver,
)

# Bounds a schema gets where the server set none (what ``single_string_schema`` does for built-ins).
STRING_MAX = 200
ARRAY_MAX = 8
_DROPPED_KEYS = ("$schema", "title", "examples", "default", "$comment", "format", "readOnly", "writeOnly")


class McpFailed(Exception):
    """The server could not be used: refused URL, unreachable, slow, too large, or a protocol error."""


class ResponseTooLarge(McpFailed):
    pass


@dataclass(frozen=True)
class McpEndpoint:
    url: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class McpLimits:
    timeout_s: float = 10.0
    max_response_bytes: int = 1 << 20
    allow_private: bool = False
    resolver: Resolver = system_resolver


@dataclass(frozen=True)
class McpToolInfo:
    """A server's tool as the server reports it."""

    name: str
    description: str
    input_schema: dict[str, Any]
    # the server's ``readOnlyHint``: only a tool it marks read-only is taken to have no side effects
    read_only: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": self.input_schema,
            "read_only": self.read_only,
        }


@dataclass(frozen=True)
class McpResult:
    text: str
    is_error: bool = False
    structured: dict[str, Any] | None = None


async def check_server_url(url: str, allow_private: bool, resolver: Resolver = system_resolver) -> None:
    """Raises RefusedAddress for a URL that is not http(s), has no host, carries credentials, or
    (unless ``allow_private``) resolves to a private, loopback or link-local address."""
    await check_url(url, resolver, allow_private=allow_private)


class _CappedStream(httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream, limit: int) -> None:
        self.inner = inner
        self.limit = limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        received = 0
        async for piece in self.inner:
            received += len(piece)
            if received > self.limit:
                raise ResponseTooLarge(f"the server answered more than {self.limit} bytes")
            yield piece

    async def aclose(self) -> None:
        await self.inner.aclose()


class _CappedTransport(httpx2.AsyncBaseTransport):
    """Counts every response's bytes as they arrive and stops past the limit; the connections
    are made by ``inner`` (the address guard)."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, limit: int) -> None:
        self.inner = inner
        self.limit = limit

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        resp = await self.inner.handle_async_request(request)
        declared = resp.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await resp.aclose()
            raise ResponseTooLarge(f"the server answered {declared} bytes, more than {self.limit}")
        stream = resp.stream
        assert isinstance(stream, httpx2.AsyncByteStream)
        return httpx2.Response(
            resp.status_code,
            headers=resp.headers,
            stream=_CappedStream(stream, self.limit),
            extensions=resp.extensions,
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


def _leaf(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


@asynccontextmanager
async def _client(endpoint: McpEndpoint, limits: McpLimits) -> AsyncIterator[Client]:
    await check_server_url(endpoint.url, limits.allow_private, limits.resolver)
    http = httpx2.AsyncClient(
        headers=endpoint.headers,
        timeout=httpx2.Timeout(limits.timeout_s),
        transport=_CappedTransport(
            GuardedTransport2(resolver=limits.resolver, allow_private=limits.allow_private),
            limits.max_response_bytes,
        ),
    )
    async with http:
        transport = streamable_http_client(
            endpoint.url, http_client=http, max_sse_event_size=limits.max_response_bytes
        )
        async with Client(transport, read_timeout_seconds=limits.timeout_s, cache=None) as client:
            yield client


async def _exchange(endpoint: McpEndpoint, limits: McpLimits, what: str, work: Any) -> Any:
    """Runs ``work(client)`` within the limits; every failure is an McpFailed naming the server."""
    host = urlsplit(endpoint.url).netloc
    try:
        async with asyncio.timeout(limits.timeout_s):
            async with _client(endpoint, limits) as client:
                return await work(client)
    except TimeoutError:
        raise McpFailed(f"MCP server {host} did not answer {what} within {limits.timeout_s:g} s") from None
    except RefusedAddress as exc:
        raise McpFailed(f"refused MCP server URL: {exc}") from None
    except Exception as exc:
        leaf = _leaf(exc)
        if isinstance(leaf, RefusedAddress):  # refused by the transport, at connect time
            raise McpFailed(f"refused MCP server URL: {leaf}") from None
        if isinstance(leaf, McpFailed):
            raise McpFailed(f"MCP server {host}: {leaf}") from None
        if isinstance(leaf, TimeoutError):
            raise McpFailed(
                f"MCP server {host} did not answer {what} within {limits.timeout_s:g} s"
            ) from None
        raise McpFailed(f"MCP server {host} failed {what}: {type(leaf).__name__}: {leaf}") from None


async def list_tools(endpoint: McpEndpoint, limits: McpLimits) -> list[McpToolInfo]:
    """The server's tools, as it reports them (every page)."""

    async def work(client: Client) -> list[McpToolInfo]:
        out: list[McpToolInfo] = []
        cursor: str | None = None
        for _ in range(20):
            page = await client.list_tools(cursor=cursor)
            out += [
                McpToolInfo(
                    t.name,
                    t.description or "",
                    dict(t.input_schema),
                    read_only=bool(t.annotations is not None and t.annotations.read_only_hint),
                )
                for t in page.tools
            ]
            cursor = page.next_cursor
            if not cursor:
                break
        return out

    result: list[McpToolInfo] = await _exchange(endpoint, limits, "tools/list", work)
    return result


def _content_text(blocks: list[Any]) -> str:
    parts: list[str] = []
    for block in blocks:
        text = getattr(block, "text", None)
        if isinstance(text, str):
            parts.append(text)
        else:
            parts.append(f"[{getattr(block, 'type', 'content')} content]")
    return "\n".join(parts)


async def call_tool(
    endpoint: McpEndpoint, tool: str, arguments: dict[str, Any], limits: McpLimits
) -> McpResult:
    """One call of ``tool``; the server's error result (bad arguments, the tool failed) is
    ``is_error``, anything else that goes wrong raises McpFailed."""

    async def work(client: Client) -> McpResult:
        result = await client.call_tool(tool, arguments)
        content = list(getattr(result, "content", None) or [])
        structured = getattr(result, "structured_content", None)
        text = _content_text(content)
        if not text and structured is not None:
            text = json.dumps(structured)
        return McpResult(text=text, is_error=bool(getattr(result, "is_error", False)), structured=structured)

    result: McpResult = await _exchange(endpoint, limits, f"tools/call {tool!r}", work)
    return result


# -- the server's JSON schema as the engine's grammar ------------------------------------------


def _resolve(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    node: Any = root
    for part in ref.removeprefix("#/").split("/"):
        node = node.get(part, {}) if isinstance(node, dict) else {}
    return node if isinstance(node, dict) else {}


def _bounded(schema: Any, root: dict[str, Any], depth: int = 0) -> dict[str, Any]:
    if not isinstance(schema, dict) or depth > 8:
        return {"type": "string", "maxLength": STRING_MAX}
    if isinstance(schema.get("$ref"), str):
        merged = {**_resolve(schema["$ref"], root), **{k: v for k, v in schema.items() if k != "$ref"}}
        return _bounded(merged, root, depth + 1)
    out = {k: v for k, v in schema.items() if k not in (*_DROPPED_KEYS, "$defs", "definitions")}
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(out.get(key), list):
            out[key] = [_bounded(s, root, depth + 1) for s in out[key]]
    kind = out.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "object" in kinds or "properties" in out:
        given = out.get("properties")
        props: dict[str, Any] = given if isinstance(given, dict) else {}
        out["properties"] = {name: _bounded(s, root, depth + 1) for name, s in props.items()}
        out.setdefault("type", "object")
        out["additionalProperties"] = False
    if "array" in kinds:
        out["items"] = _bounded(out.get("items", {"type": "string"}), root, depth + 1)
        out.setdefault("maxItems", ARRAY_MAX)
    if "string" in kinds and not ({"pattern", "enum", "const", "maxLength"} & set(out)):
        out["maxLength"] = STRING_MAX
    return out


def constrained_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A server's input schema as the engine constrains calls with it: local ``$ref`` inlined,
    annotations that grammars ignore dropped, objects closed to other keys, strings and arrays
    bounded where the server left them open (a small model otherwise runs on inside a string
    until ``max_tokens`` cuts the call). What the server accepts is unchanged or narrower."""
    out = _bounded(schema or {"type": "object"}, schema or {})
    if out.get("type") != "object":
        out = {"type": "object", "properties": {}, "additionalProperties": False}
    return out


# -- one server tool as an agent tool ---------------------------------------------------------


def agent_tool_name(server: str, tool: str) -> str:
    """The name an agent calls a server's tool by (OpenAI's function-name alphabet, 64 at most)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"{server}__{tool}")[:64]


class McpToolError(Exception):
    """The server's tool answered with an error result (the agent reads its text)."""


def _arguments(argument: Any, schema: dict[str, Any]) -> dict[str, Any]:
    if isinstance(argument, dict):
        return argument
    text = str(argument).strip()
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        return parsed
    # A text protocol's single input: the schema's one (required) string argument.
    props = schema.get("properties")
    props = props if isinstance(props, dict) else {}
    required = [p for p in schema.get("required") or [] if p in props] or list(props)
    return {required[0]: text} if required else {}


@dataclass
class McpTool:
    """A tool of a registered MCP server, as an agent tool (``Tool`` protocol)."""

    name: str
    description: str
    parameters: dict[str, Any]
    server: str
    tool: str
    endpoint: McpEndpoint
    limits: McpLimits
    # a tool the server does not mark read-only may act on the world (the agent's side_effects policy)
    side_effects: bool = True

    @classmethod
    def of(cls, server: str, info: McpToolInfo, endpoint: McpEndpoint, limits: McpLimits) -> McpTool:
        description = info.description or f"The {info.name} tool"
        return cls(
            name=agent_tool_name(server, info.name),
            description=f"{description[:300]} (MCP server {server!r})",
            parameters=constrained_schema(info.input_schema),
            server=server,
            tool=info.name,
            endpoint=endpoint,
            limits=limits,
            side_effects=not info.read_only,
        )

    async def run(self, argument: Any, ctx: ToolContext) -> str:
        # the agent shows the result to the model inside a tool_result data block (prompting.py)
        result = await call_tool(self.endpoint, self.tool, _arguments(argument, self.parameters), self.limits)
        if result.is_error:
            raise McpToolError(result.text)
        return result.text


@dataclass
class UnavailableServer:
    """Stands in for a server whose tools could not be listed: an agent run is not offered it, and
    its ``tools`` step says why (agents/offering.py); called anyway, it raises that error."""

    name: str
    description: str
    parameters: dict[str, Any]
    error: str
    server: str = ""

    @classmethod
    def of(cls, server: str, error: str) -> UnavailableServer:
        return cls(
            name=agent_tool_name(server, "unavailable"),
            description=f"MCP server {server!r} (unavailable right now)",
            parameters={"type": "object", "properties": {}, "additionalProperties": False},
            error=error,
            server=server,
        )

    async def run(self, argument: Any, ctx: ToolContext) -> str:
        raise McpFailed(self.error)
