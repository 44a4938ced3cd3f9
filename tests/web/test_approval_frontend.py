"""A held tool call in the chat page, in a real browser against the real agent service (which
serves the built front end): the page shows the tool and its arguments as text, and Approve runs
the call and shows the continued answer."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from services.agent.agents.runner import AgentSpec
from services.common.auth import KeyStore
from tests.agent.stack import Stack, agent_stack
from tests.agent.test_approvals import AGENT, Recorder, call
from tests.web.conftest import DIST

TARGET = "<img src=x onerror=alert(1)>"


@pytest.fixture()
def served(redis_url: str, tmp_path: Any) -> Iterator[tuple[Stack, Recorder]]:
    with agent_stack(redis_url, tmp_path / "home", web_dist=str(DIST)) as stack:
        runtime = stack.app.state.runtime
        tool = Recorder()
        runtime.tools["act"] = tool
        runtime.agents[AGENT] = AgentSpec(
            name=AGENT, description="acts", tools=["calculator", "act"], mode="openai", side_effects="approve"
        )
        yield stack, tool


def test_approve_in_the_chat_runs_the_call_and_shows_the_answer(
    page: Any, served: tuple[Stack, Recorder], key_store: KeyStore
) -> None:
    stack, tool = served
    key = key_store.create(f"apr-page-{uuid.uuid4().hex[:8]}")[0]
    page.goto(f"{stack.url}/#/signin?next=chat")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r".*#/chat"))
    page.get_by_label("Kind").select_option("agent")
    page.get_by_label("Pipeline or agent").select_option(AGENT)

    stack.model.replies = [call({"target": TARGET})]
    page.get_by_label("Message", exact=True).fill("Act on the page")
    page.keyboard.press("Enter")
    box = page.get_by_role("region", name="Approve act")
    box.wait_for()
    assert box.locator(".approval-tool").inner_text() == "act"
    # the arguments are text: the markup in them is shown, never built
    assert TARGET in box.locator(".approval-args").inner_text()
    assert page.locator(".approval-args img").count() == 0
    assert tool.calls == []

    stack.model.replies = [call({"target": TARGET}), "Acted on it."]
    box.get_by_role("button", name="Approve").click()
    answer = page.locator(".msg.assistant[aria-busy='false']").filter(has_text="Acted on it.")
    answer.wait_for()
    assert box.get_by_role("button", name="Approve").is_disabled()
    assert tool.calls == [{"target": TARGET}]
    assert page.page_errors == []
