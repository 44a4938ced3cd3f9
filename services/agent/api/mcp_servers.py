"""``/v1/mcp/servers``: the tenant's registered MCP servers (their tools join agent runs).

Registering, changing and removing a server decide what every agent run of the tenant may call
(and which headers, often credentials, go with the calls): admins only, like keys and models;
members and viewers list the servers and their tools."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from services.agent.api.deps import PrincipalDep, RuntimeDep
from services.agent.mcp_servers import McpServerCreate, McpServerInfo, McpServerList, McpServerUpdate
from services.agent.tools.mcp import McpFailed, list_tools
from services.common.app_factory import RouteResponses
from services.common.audit import audit_request
from services.common.auth import require_admin
from services.common.errors import UpstreamError

router = APIRouter(tags=["mcp"], responses={404: {"description": "no such MCP server"}})

NOT_ADMIN: RouteResponses = {
    403: {"description": "not an admin of the tenant (the message names the caller's role)"}
}


@router.post(
    "/v1/mcp/servers",
    status_code=201,
    response_model=McpServerInfo,
    responses={
        400: {"description": "invalid server: the URL is not http(s), or private (the message names it)"},
        409: {"description": "a server of that name is already registered"},
        **NOT_ADMIN,
    },
)
async def register_server(
    body: McpServerCreate, request: Request, runtime: RuntimeDep, principal: PrincipalDep
) -> McpServerInfo:
    """Registers an MCP server (Streamable HTTP); header values are stored encrypted, never returned."""
    require_admin(principal, "POST /v1/mcp/servers (registering an MCP server)")
    info = await runtime.mcp.add(principal.tenant, body)
    await audit_request(request, "mcp_server.register", info.name, {"url": info.url})
    return info


@router.get("/v1/mcp/servers")
async def list_servers(runtime: RuntimeDep, principal: PrincipalDep) -> McpServerList:
    return McpServerList(data=await runtime.mcp.servers(principal.tenant))


@router.get(
    "/v1/mcp/servers/{name}/tools",
    responses={502: {"description": "the server could not be reached, or answered too slowly or too much"}},
)
async def server_tools(name: str, runtime: RuntimeDep, principal: PrincipalDep) -> dict[str, Any]:
    """The server's tools as it reports them (name, description, input schema)."""
    endpoint = await runtime.mcp.endpoint(principal.tenant, name)
    try:
        tools = await list_tools(endpoint, runtime.mcp.limits())
    except McpFailed as exc:
        raise UpstreamError(str(exc), param="name", code="mcp_server_failed") from None
    return {"server": name, "data": [t.to_dict() for t in tools]}


@router.patch("/v1/mcp/servers/{name}", response_model=McpServerInfo, responses=NOT_ADMIN)
async def update_server(
    name: str, body: McpServerUpdate, request: Request, runtime: RuntimeDep, principal: PrincipalDep
) -> McpServerInfo:
    """Which agents get the server's tools (``agents``), and which of its tools (``tools``)."""
    require_admin(principal, "PATCH /v1/mcp/servers/{name} (changing an MCP server)")
    info = await runtime.mcp.update(principal.tenant, name, body)
    await audit_request(request, "mcp_server.update", name, body.model_dump(mode="json", exclude_unset=True))
    return info


@router.delete("/v1/mcp/servers/{name}", status_code=204, responses=NOT_ADMIN)
async def delete_server(
    name: str, request: Request, runtime: RuntimeDep, principal: PrincipalDep
) -> Response:
    require_admin(principal, "DELETE /v1/mcp/servers/{name} (removing an MCP server)")
    await runtime.mcp.delete(principal.tenant, name)
    await audit_request(request, "mcp_server.remove", name)
    return Response(status_code=204)
