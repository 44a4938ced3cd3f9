"""The viewer role, across the four services' routes: every route that writes on retrieval and
the trainer refuses a viewer (search aside), the agent's feedback, training, evaluation, MCP,
model and user routes refuse it, and chat stays open to it. Read from the apps' own routes, so
a new route is checked without being listed here."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.routing import APIRoute, iter_route_contexts

from services.common.auth import ADMIN, MEMBER, SAFE_METHODS, VIEWER, Principal, viewer_refusal
from tests.test_request_bounds import _build

VIEWER_USER = Principal(tenant="t", key_id="u_1", role=VIEWER, user_id="u_1")
# the agent's routes a viewer may write to: chat in its forms, and its own conversations
AGENT_CHAT = {
    "/v1/pipelines/{name}/run",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/agents/approvals/{approval_id}",
    "/v1/conversations/{conversation_id}",
    "/v1/messages/{message_id}/regenerate",
    # its own tokens (the route itself refuses anything more to a non-admin)
    "/v1/users/{user_id}/tokens",
    "/v1/users/{user_id}/tokens/{token_id}",
    # signing out of its own browser session
    "/v1/auth/logout",
}


def writes(service: str, home: Path) -> set[tuple[str, str]]:
    app = _build(service, home)
    return {
        (method, str(context.path))
        for context in iter_route_contexts(app.routes)
        if isinstance(context.original_route, APIRoute)
        for method in context.original_route.methods - SAFE_METHODS
    }


@pytest.mark.parametrize("service", ["retrieval", "trainer", "agent", "inference"])
def test_a_viewer_writes_nothing_but_chat(service: str, tmp_path: Path) -> None:
    routes = writes(service, tmp_path)
    assert routes
    for method, path in sorted(routes):
        refusal = viewer_refusal(VIEWER_USER, method, path)
        if service in ("retrieval", "trainer"):
            assert (refusal is None) == path.endswith("/search"), (method, path)
        elif service == "agent":
            if path in AGENT_CHAT or path.startswith("/mcp"):
                assert refusal is None, (method, path)
            else:
                assert path.startswith(
                    (
                        "/v1/feedback",
                        "/v1/messages/",
                        "/v1/evals",
                        "/v1/mcp/servers",
                        "/v1/models",
                        "/v1/users",
                        "/v1/collections",
                        "/v1/responses/",
                        "/api/",
                    )
                ), (method, path)
            if path.startswith(
                ("/v1/feedback", "/v1/messages/{message_id}/choose", "/v1/evals", "/v1/mcp/servers")
            ):
                assert refusal is not None and "viewer" in refusal.message, (method, path)
        if refusal is not None:
            assert path in refusal.message and "member or admin" in refusal.message
        # members and admins are never refused by role here
        for role in (MEMBER, ADMIN):
            assert viewer_refusal(Principal(tenant="t", key_id="k", role=role), method, path) is None
