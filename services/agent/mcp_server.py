"""Tandem as an MCP server: Streamable HTTP at ``/mcp`` (the official SDK's ``MCPServer``).

Tools: ``search`` (a collection, with mode, top_k and filters), ``ask`` (the chat-documents
pipeline: an answer with citations), ``list_collections``, and one tool per agent definition;
resources: a collection's documents, ``tandem://collections/{name}/documents/{id}``.

The route is one of the service's keyed routes, so the guard in front of every service
(services/common/guard.py) checks the tenant's API key (a Bearer token), the body size and the
tenant's rate and concurrency before the SDK sees a byte. Every tool then works with the
caller's own key against retrieval and inference, so a tenant reaches only its own collections.
The server is stateless and answers JSON.

Before the SDK sees a request, the endpoint refuses, in this order: a ``Host`` or ``Origin`` the
service is not served under (DNS rebinding: the SDK's transport security, with the hosts of
``allowed_hosts``); any method but POST (405: no long-lived stream holds a concurrency slot); a
body that is not one JSON-RPC request or notification as MCP defines it (a 400 with a JSON-RPC
``-32600`` error naming the member). Tool arguments outside a tool's schema, unknown fields
included, are a tool error naming the field.

Tool inputs are the REST routes' pydantic models: ``ask`` and the agent tools take
``POST /v1/pipelines/{name}/run``'s body (``PipelineRunRequest``, less ``stream``), ``search``
the retrieval search route's body with the collection of its path.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError
from mcp.server.mcpserver.tools import Tool
from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from mcp_types import INVALID_REQUEST, PARSE_ERROR, ErrorData, JSONRPCError
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from services.agent.config import AgentSettings
from services.agent.events import ErrorEvent
from services.agent.protocol import PipelineRunRequest
from services.agent.runtime import AgentRuntime, Turn, TurnResult, collect
from services.common.auth import JwtAuthenticator, Principal, verify_key
from services.common.config import CommonSettings
from services.common.errors import TandemError, error_body
from services.common.guard import _read_all, _replay
from services.common.http import service_client
from services.common.jsonsafe import JsonObject

MCP_PATH = "/mcp"
ASK_PIPELINE = "chat-documents"
COLLECTION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
DOCUMENT_URI = "tandem://collections/{name}/documents/{id}"


class SearchArguments(BaseModel):
    """``POST /v1/collections/{collection}/search``'s body, with the collection of its path."""

    model_config = ConfigDict(extra="forbid")

    collection: str = Field(..., pattern=COLLECTION_PATTERN, description="The collection to search.")
    query: str = Field(..., min_length=1, max_length=8192)
    top_k: int = Field(10, ge=1, le=100)
    mode: Literal["dense", "sparse", "hybrid"] = "hybrid"
    filters: JsonObject | None = None
    rerank: bool = False


class _Caller:
    """The principal and key of the MCP request being served (from its Authorization header;
    the guard has already refused requests without a valid key)."""

    def __init__(self, principal: Principal, key: str) -> None:
        self.principal = principal
        self.key = key


async def _caller(ctx: Context[Any, Any], runtime_redis: Any, jwt: JwtAuthenticator | None = None) -> _Caller:
    headers = ctx.headers or {}
    scheme, _, token = str(headers.get("authorization", "")).partition(" ")
    principal = await verify_key(runtime_redis, token.strip(), jwt) if scheme.lower() == "bearer" else None
    if principal is None:
        raise ToolError("invalid or revoked API key")
    return _Caller(principal, token.strip())


def _tool_error(exc: TandemError) -> ToolError:
    where = f" ({exc.param})" if exc.param else ""
    return ToolError(f"{exc.message}{where}")


def _validated(model: type[BaseModel], arguments: JsonObject) -> Any:
    try:
        return model.model_validate({k: v for k, v in arguments.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ToolError(f"invalid arguments: {problems}") from None


def _model_tool(
    model: type[BaseModel],
    run: Callable[[Any, Context[Any, Any]], Awaitable[JsonObject]],
    skip: tuple[str, ...] = (),
) -> Callable[..., Awaitable[JsonObject]]:
    """A tool function whose arguments are ``model``'s fields (so the SDK publishes, and checks
    calls against, the REST route's own schema); the call is validated by ``model`` itself."""

    async def tool(ctx: Context[Any, Any], **arguments: Any) -> JsonObject:
        return await run(_validated(model, arguments), ctx)

    params = [inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=Context)]
    # the SDK publishes the return annotation as the tool's outputSchema: the tools answer the
    # REST routes' JSON, published as a plain object
    annotations: dict[str, object] = {"ctx": Context, "return": JsonObject}
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        params.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, annotation=field.annotation, default=field
            )
        )
        annotations[name] = field.annotation
    tool.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    tool.__annotations__ = annotations
    return tool


def _strict_tool(fn: Callable[..., Any], name: str, description: str) -> Tool:
    """``fn`` as a tool whose arguments model forbids fields it does not declare: the SDK's own
    model ignores them, so a misspelt or invented argument would be dropped silently. The
    published ``inputSchema`` says so too (``additionalProperties: false``)."""
    tool = Tool.from_function(fn, name=name, description=description)
    loose = tool.fn_metadata.arg_model
    strict: type[BaseModel] = type(
        loose.__name__, (loose,), {"model_config": ConfigDict(**loose.model_config, extra="forbid")}
    )
    return tool.model_copy(
        update={
            "fn_metadata": tool.fn_metadata.model_copy(update={"arg_model": strict}),
            "parameters": strict.model_json_schema(by_alias=True),
        }
    )


def build_mcp_server(
    runtime: AgentRuntime, redis_client: Any, jwt: JwtAuthenticator | None = None
) -> MCPServer:
    """``jwt``: the checker of the OpenID provider's JWTs, which are bearer tokens here too."""

    async def caller(ctx: Context[Any, Any]) -> _Caller:
        return await _caller(ctx, redis_client, jwt)

    async def search(args: SearchArguments, ctx: Context[Any, Any]) -> JsonObject:
        who = await caller(ctx)
        try:
            chunks = await runtime.upstreams.retrieval(who.key).search(
                args.collection,
                args.query,
                top_k=args.top_k,
                mode=args.mode,
                rerank=args.rerank,
                filters=args.filters,
            )
        except TandemError as exc:
            raise _tool_error(exc) from None
        return {"collection": args.collection, "results": [c.to_result() for c in chunks]}

    def turn_tool(
        target: str,
    ) -> Callable[[PipelineRunRequest, Context[Any, Any]], Awaitable[JsonObject]]:
        async def run(body: PipelineRunRequest, ctx: Context[Any, Any]) -> JsonObject:
            who = await caller(ctx)
            turn = Turn.of_run(target, body)
            result = TurnResult()
            try:
                events = await collect(runtime.turn(who.principal, who.key, turn, result))
            except TandemError as exc:
                raise _tool_error(exc) from None
            errors = [e for e in events if isinstance(e, ErrorEvent)]
            if errors:
                raise ToolError(f"{errors[-1].message} ({errors[-1].code})")
            return result.pipeline_answer(target, turn.message, None)

        return run

    async def list_collections(ctx: Context[Any, Any]) -> JsonObject:
        who = await caller(ctx)
        async with service_client(runtime.common.url_of("retrieval"), who.key, 30.0) as client:
            try:
                resp = await client.get("/v1/collections")
            except httpx.HTTPError as exc:
                raise ToolError(f"retrieval service unreachable: {type(exc).__name__}") from None
        if resp.status_code != 200:
            raise ToolError(f"retrieval answered {resp.status_code}: {resp.text[:200]}")
        return dict(resp.json())

    tools = [
        _strict_tool(
            _model_tool(SearchArguments, search),
            "search",
            "Searches one of your collections (dense, sparse or hybrid); returns the matching passages.",
        ),
        _strict_tool(
            _model_tool(PipelineRunRequest, turn_tool(ASK_PIPELINE), skip=("stream",)),
            "ask",
            "Answers a question from a collection's documents, citing its sources as [n].",
        ),
        _strict_tool(list_collections, "list_collections", "Lists your collections."),
    ]
    for name, spec in runtime.agents.items():
        if name in ("search", "ask", "list_collections"):
            continue
        tools.append(
            _strict_tool(
                _model_tool(PipelineRunRequest, turn_tool(name), skip=("stream",)), name, spec.description
            )
        )
    mcp: MCPServer = MCPServer(
        "tandem",
        instructions="Search and ask the caller's document collections, and run Tandem's agents.",
        tools=tools,
    )

    @mcp.resource(DOCUMENT_URI, name="document", mime_type="application/json")
    async def document(name: str, id: str, ctx: Context[Any, Any]) -> str:
        """A document of one of your collections (its text and metadata, as JSON)."""
        who = await caller(ctx)
        async with service_client(runtime.common.url_of("retrieval"), who.key, 30.0) as client:
            try:
                resp = await client.get(f"/v1/collections/{name}/documents/{id}")
            except httpx.HTTPError as exc:
                raise ResourceError(f"retrieval service unreachable: {type(exc).__name__}") from None
        if resp.status_code != 200:
            raise ResourceError(f"no document {id!r} in collection {name!r} (retrieval: {resp.status_code})")
        return json.dumps(resp.json())

    return mcp


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _host_form(name: str) -> str:
    return f"[{name}]" if ":" in name else name


def allowed_hosts(common: CommonSettings, settings: AgentSettings) -> list[str]:
    """The ``Host`` values ``/mcp`` answers (the SDK's syntax: ``name``, ``name:port``, ``name:*``).

    The loopback names on any port: a rebinding page reaches the service under the attacker's
    name, never under these, and a published port (a container's, a tunnel's) differs from the
    bound one. Then the bound address when it is a specific one (``TANDEM_HOST``,
    ``TANDEM_AGENT_PORT``), the host of ``TANDEM_AGENT_URL``, and
    ``TANDEM_AGENT_MCP_ALLOWED_HOSTS``."""
    hosts = [*LOOPBACK_HOSTS, *(f"{h}:*" for h in LOOPBACK_HOSTS)]
    if common.host not in ("0.0.0.0", "::", "127.0.0.1", "localhost", "::1"):
        hosts.append(f"{_host_form(common.host)}:{common.agent_port}")
    public = urlsplit(common.agent_url)
    if public.hostname:
        name = _host_form(public.hostname)
        if public.port is None or public.port == _DEFAULT_PORTS.get(public.scheme):
            hosts.append(name)  # clients leave a default port out of Host
        hosts.append(f"{name}:{public.port or _DEFAULT_PORTS.get(public.scheme, 80)}")
    hosts += settings.mcp_allowed_host_list()
    return list(dict.fromkeys(hosts))


def transport_security(hosts: list[str]) -> TransportSecuritySettings:
    """Host and Origin checks: a browser's ``Origin`` must be a page served from an allowed host
    (``null``, a sandboxed or file page, is refused); a request without one (a non-browser
    client) passes on its ``Host``."""
    origins = [f"{scheme}://{h}" for h in hosts for scheme in ("http", "https")]
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True, allowed_hosts=hosts, allowed_origins=origins
    )


class EnvelopeError(ValueError):
    """A body that is not one JSON-RPC request or notification as MCP defines it."""

    def __init__(self, code: int, member: str | None, message: str, request_id: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.member = member
        self.message = message
        self.request_id = request_id

    def body(self) -> JsonObject:
        error = ErrorData(code=self.code, message=self.message, data={"member": self.member})
        return JSONRPCError(jsonrpc="2.0", id=self.request_id, error=error).model_dump(
            mode="json", by_alias=True
        )


_MEMBERS = ("jsonrpc", "id", "method", "params")


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        int: "an integer",
        float: "a number with a fraction",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def check_envelope(body: bytes) -> None:
    """Raises ``EnvelopeError`` unless ``body`` is one JSON-RPC 2.0 request (``id`` a string or an
    integer, as MCP requires: never null, a fraction, a boolean or a structure) or notification
    (no ``id``), with a string ``method`` and an object ``params`` or none. The SDK would take an
    ``id`` it cannot use as a notification, and answers a malformed envelope with a generic
    error; batches are not part of the protocol since 2025-06-18. A posted response is refused
    too: the server is stateless and sends no requests to answer."""
    try:
        message = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise EnvelopeError(PARSE_ERROR, None, f"Parse error: the body is not JSON ({exc})") from None
    if isinstance(message, list):
        raise EnvelopeError(
            INVALID_REQUEST, None, "Invalid Request: batches are not supported; send one message per POST"
        )
    if not isinstance(message, dict):
        raise EnvelopeError(
            INVALID_REQUEST,
            None,
            f"Invalid Request: the body must be a JSON-RPC object, got {_kind(message)}",
        )
    request_id = message.get("id")
    if "id" in message and (isinstance(request_id, bool) or not isinstance(request_id, str | int)):
        raise EnvelopeError(
            INVALID_REQUEST,
            "id",
            f"Invalid Request: 'id' must be a string or an integer, got {_kind(request_id)}",
        )

    def refuse(member: str, why: str) -> EnvelopeError:
        return EnvelopeError(INVALID_REQUEST, member, f"Invalid Request: {why}", request_id)

    if message.get("jsonrpc") != "2.0":
        raise refuse("jsonrpc", f"'jsonrpc' must be \"2.0\", got {json.dumps(message.get('jsonrpc'))[:40]}")
    if "method" not in message:
        raise refuse(
            "method", "'method' is missing (this server sends no requests, so it takes no responses)"
        )
    if not isinstance(message["method"], str):
        raise refuse("method", f"'method' must be a string, got {_kind(message['method'])}")
    if "params" in message and not isinstance(message["params"], dict):
        raise refuse("params", f"'params' must be an object when present, got {_kind(message['params'])}")
    for member in message:
        if member not in _MEMBERS:
            raise refuse(member, f"unknown member {member!r} (a request has {', '.join(_MEMBERS)})")


class McpEndpoint:
    """``/mcp``'s ASGI endpoint: Host and Origin (the SDK's DNS rebinding checks), then the
    JSON-RPC envelope, then the SDK's Streamable HTTP transport."""

    def __init__(self, transport: ASGIApp, security: TransportSecuritySettings) -> None:
        self.transport = transport
        self.security = TransportSecurityMiddleware(security)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        refused = await self.security.validate_request(request)
        if refused is not None:
            # The SDK's plain-text refusal, in the service's error shape: 421 for Host, 403 for Origin.
            header = "Host" if refused.status_code == 421 else "Origin"
            value = request.headers.get(header.lower(), "")
            message = (
                f"this service does not answer MCP requests with {header} {value!r} (a DNS rebinding "
                "guard); add the name the service is reached under to TANDEM_AGENT_MCP_ALLOWED_HOSTS"
            )
            body = error_body("permission_error", message, header.lower(), f"{header.lower()}_not_allowed")
            await JSONResponse(body, status_code=refused.status_code)(scope, receive, send)
            return
        if scope["method"] != "POST":
            # Stateless: no stream to offer a GET (the spec's answer is a 405, given at once, so no
            # idle stream holds one of the tenant's concurrency slots), no session to DELETE.
            body = error_body(
                "invalid_request_error",
                f"{scope['method']} is not served on {MCP_PATH}: the server is stateless and takes "
                "POST only (one JSON-RPC message, answered as JSON)",
                None,
                "method_not_allowed",
            )
            await JSONResponse(body, status_code=405, headers={"Allow": "POST"})(scope, receive, send)
            return
        raw = await _read_all(receive)
        try:
            # Parsing a large body takes milliseconds per MiB: off the event loop, as the guard does.
            if len(raw) < 256 * 1024:
                check_envelope(raw)
            else:
                await run_in_threadpool(check_envelope, raw)
        except EnvelopeError as exc:
            await JSONResponse(exc.body(), status_code=400)(scope, receive, send)
            return
        await self.transport(scope, _replay(raw, receive), send)


class _MountedMcp:
    """The ``/mcp`` route's ASGI endpoint: the app's ``McpEndpoint``, built with its runtime
    (``install_mcp``), after the routers were handed to the app factory."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint: ASGIApp = scope["app"].state.mcp_endpoint
        await endpoint(scope, receive, send)


def install_mcp(app: Any, runtime: AgentRuntime) -> MCPServer:
    """Builds the MCP server and its Streamable HTTP endpoint; the app's lifespan runs
    ``app.state.mcp.session_manager.run()``."""
    mcp = build_mcp_server(runtime, app.state.redis, getattr(app.state, "oidc", None))
    security = transport_security(allowed_hosts(runtime.common, runtime.settings))
    http = mcp.streamable_http_app(
        streamable_http_path=MCP_PATH,
        stateless_http=True,
        json_response=True,
        transport_security=security,
    )
    app.state.mcp = mcp
    transport = next(r for r in http.routes if isinstance(r, Route) and r.path == MCP_PATH).endpoint
    app.state.mcp_endpoint = McpEndpoint(transport, security)
    return mcp


def mcp_routers() -> tuple[APIRouter, APIRouter]:
    """(the keyed router with ``/mcp``, the public router with the OAuth metadata)."""
    keyed = APIRouter(tags=["mcp"])
    # GET and DELETE are routed here to be answered 405 by the endpoint itself (with POST only,
    # the router would hand a GET on to the web front end's catch-all mount).
    keyed.routes.append(Route(MCP_PATH, endpoint=_MountedMcp(), methods=["GET", "POST", "DELETE"]))
    public = APIRouter(tags=["mcp"])

    def metadata(request: Request) -> JSONResponse:
        base = str(request.base_url).rstrip("/")
        return JSONResponse(
            {
                "resource": f"{base}{MCP_PATH}",
                # No authorization server: Tandem API keys are the scheme (`tandem keys create`).
                "authorization_servers": [],
                "bearer_methods_supported": ["header"],
                "resource_name": "Tandem",
                "tandem_auth": {
                    "scheme": "api_key",
                    "header": "Authorization: Bearer <Tandem API key>",
                    "oauth": False,
                },
            }
        )

    def no_authorization_server(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "type": "not_found_error",
                    "message": "Tandem runs no OAuth authorization server: send a Tandem API key "
                    "as 'Authorization: Bearer <key>'",
                    "param": None,
                    "code": "api_key_auth",
                }
            },
            status_code=404,
        )

    for path in ("/.well-known/oauth-protected-resource", f"/.well-known/oauth-protected-resource{MCP_PATH}"):
        public.add_api_route(path, metadata, methods=["GET"], include_in_schema=False)
    for path in ("/.well-known/oauth-authorization-server", "/.well-known/openid-configuration"):
        public.add_api_route(path, no_authorization_server, methods=["GET"], include_in_schema=False)
    return keyed, public
