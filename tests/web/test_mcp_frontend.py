"""The "MCP servers" page in a real browser, against the real agent service (which serves the
built front end) and a real MCP server on 127.0.0.1: add a server, see its tools, enable it and
single tools of it for an agent."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from services.common.auth import KeyStore
from tests.agent.stack import Stack, agent_stack
from tests.agent.test_mcp_client import mcp_server
from tests.conftest import auth
from tests.web.conftest import DIST

SECRET = "Bearer page-secret-91c2"


@pytest.fixture()
def served(redis_url: str, tmp_path: Any) -> Iterator[tuple[Stack, str]]:
    with (
        mcp_server() as (url, _),
        agent_stack(redis_url, tmp_path / "home", mcp_allow_private=True, web_dist=str(DIST)) as stack,
    ):
        yield stack, url


@pytest.fixture()
def page_key(key_store: KeyStore) -> str:
    """A key of a tenant of its own: the page must start empty, whatever servers other tests
    registered for their tenants in the session's Valkey."""
    return key_store.create(f"mcp-page-{uuid.uuid4().hex[:8]}")[0]


def test_add_a_server_see_its_tools_and_enable_them_per_agent(
    page: Any, served: tuple[Stack, str], page_key: str
) -> None:
    stack, mcp_url = served
    api_key = page_key
    page.goto(f"{stack.url}/#/signin?next=mcp")
    page.get_by_label("API key").fill(api_key)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r".*#/mcp$"))
    assert page.get_by_role("link", name="MCP servers").get_attribute("aria-current") == "page"
    page.get_by_text("No MCP servers yet.").wait_for()

    page.get_by_label("Name").fill("kb")
    page.get_by_label("URL").fill(mcp_url)
    page.get_by_label("Headers").fill(f"Authorization: {SECRET}")
    page.get_by_role("button", name="Add server").click()
    card = page.get_by_role("region", name="MCP server kb")
    card.wait_for()
    assert "Authorization (hidden)" in card.inner_text() and SECRET not in page.content()

    card.get_by_role("button", name="Show tools").click()
    tools = card.get_by_role("list", name="Tools of kb")
    tools.wait_for()
    assert {"lookup_capital", "hang", "flood"} <= set(tools.locator("code").all_inner_texts())

    card.get_by_label("tools-agent").check()
    card.get_by_role("button", name="Save agents").click()
    page.get_by_text("kb saved").first.wait_for()

    def stored() -> dict[str, Any]:
        servers = httpx.get(f"{stack.url}/v1/mcp/servers", headers=auth(api_key)).json()["data"]
        return dict(servers[0])

    assert stored()["agents"] == ["tools-agent"]

    card = page.get_by_role("region", name="MCP server kb")
    card.get_by_role("button", name="Show tools").click()
    tools = card.get_by_role("list", name="Tools of kb")
    tools.wait_for()
    for name in ("hang", "flood"):
        tools.get_by_role("checkbox", name=name).uncheck()
    card.get_by_role("button", name="Save enabled tools").click()
    page.get_by_role("region", name="MCP server kb").get_by_text("Enabled tools: lookup_capital").wait_for()
    assert stored()["tools"] == ["lookup_capital"]

    # a refused URL is shown as the service's message
    page.get_by_label("Name").fill("bad")
    page.get_by_label("URL").fill("ftp://example.com/mcp")
    page.get_by_role("button", name="Add server").click()
    page.locator("#mcp-add-error").filter(has_text="http and https").wait_for()
    assert page.page_errors == []
