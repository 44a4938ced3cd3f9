"""Held tool calls over HTTP: an agent with ``side_effects: approve`` stops at a side-effecting
call; ``POST /v1/agents/approvals/{id}`` runs the turn again with that exact call allowed (or
refused), once, for the key that asked, before the approval expires (an injected clock)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from services.agent.agents.runner import AgentSpec
from services.agent.tools.base import ToolContext
from services.common.auth import KeyStore
from tests.agent.stack import Stack, agent_stack
from tests.conftest import auth

AGENT = "act-agent"


class Recorder:
    """A tool with side effects that records each call it really makes."""

    name = "act"
    description = "Acts on a target."
    side_effects = True

    def __init__(self) -> None:
        self.parameters: dict[str, Any] = {
            "type": "object",
            "properties": {"target": {"type": "string"}},
            "required": ["target"],
        }
        self.calls: list[Any] = []

    def run(self, argument: Any, ctx: ToolContext) -> str:
        self.calls.append(argument)
        return f"acted on {argument['target']}"


class Clock:
    """time.time(), moved on by ``ahead`` seconds."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.time() + self.ahead


def call(args: dict[str, Any]) -> dict[str, Any]:
    fn = {"name": "act", "arguments": json.dumps(args)}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": fn}],
    }


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with agent_stack(redis_url, tmp_path_factory.mktemp("home"), approval_ttl_s=60) as s:
        runtime = s.app.state.runtime
        runtime.agents[AGENT] = AgentSpec(
            name=AGENT, description="acts", tools=["calculator", "act"], mode="openai", side_effects="approve"
        )
        yield s


@pytest.fixture()
def tool(stack: Stack) -> Recorder:
    recorder = Recorder()
    stack.app.state.runtime.tools["act"] = recorder
    return recorder


@pytest.fixture()
def clock(stack: Stack) -> Iterator[Clock]:
    store = stack.app.state.runtime.approvals
    clock = Clock()
    store.clock = clock
    yield clock
    store.clock = time.time


@pytest.fixture()
def keys(key_store: KeyStore) -> tuple[str, str]:
    """An admin key and a member key of one new tenant."""
    tenant = f"apr-{uuid.uuid4().hex[:8]}"
    return key_store.create(tenant, role="admin")[0], key_store.create(tenant, role="member")[0]


def held(stack: Stack, key: str, target: str = "x") -> dict[str, Any]:
    """Asks the agent; its model calls ``act``; returns the approval_required step."""
    stack.model.replies = [call({"target": target})]
    resp = httpx.post(
        f"{stack.url}/v1/pipelines/{AGENT}/run",
        json={"query": f"Act on {target}", "remember": True},
        headers=auth(key),
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["finish_reason"] == "approval_required", body
    step = body["steps"][-1]
    assert step["type"] == "approval_required" and step["tool"] == "act"
    assert step["arguments"] == {"target": target}
    return {**step, "conversation_id": body["conversation_id"]}


def decide(stack: Stack, key: str, approval_id: str, body: Any) -> httpx.Response:
    return httpx.post(
        f"{stack.url}/v1/agents/approvals/{approval_id}", json=body, headers=auth(key), timeout=30
    )


def test_approving_runs_that_call_once_and_answers_with_the_continued_run(
    stack: Stack, tool: Recorder, clock: Clock, api_key: str
) -> None:
    step = held(stack, api_key)
    assert tool.calls == []  # held, not made
    assert step["expires_at"] == pytest.approx(time.time() + 60, abs=5)
    pending = httpx.get(f"{stack.url}/v1/agents/approvals", headers=auth(api_key)).json()["data"]
    assert [(p["approval_id"], p["tool"], p["arguments"]) for p in pending] == [
        (step["approval_id"], "act", {"target": "x"})
    ]

    stack.model.requests.clear()
    stack.model.replies = [call({"target": "x"}), "acted: done"]
    resp = decide(stack, api_key, step["approval_id"], {"approve": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["answer"] == "acted: done" and body["decision"] == "approved"
    assert body["conversation_id"] == step["conversation_id"]
    assert tool.calls == [{"target": "x"}]
    observation = next(s for s in body["steps"] if s.get("kind") == "observation")
    assert observation["ok"] and observation["text"] == "acted on x"
    # the re-run asks the same question once, after the same history
    first = stack.model.requests[0]["messages"]
    assert [m["content"] for m in first if m["role"] == "user"].count("Act on x") == 1

    conv = httpx.get(f"{stack.url}/v1/conversations/{step['conversation_id']}", headers=auth(api_key)).json()
    assert [(m["role"], m["content"]) for m in conv["messages"]] == [
        ("user", "Act on x"),
        ("assistant", ""),
        ("assistant", "acted: done"),
    ]
    assert httpx.get(f"{stack.url}/v1/agents/approvals", headers=auth(api_key)).json()["data"] == []
    # one decision only, whichever it is
    for again in ({"approve": True}, {"approve": False}):
        second = decide(stack, api_key, step["approval_id"], again)
        assert second.status_code == 409, second.text
        assert "already approved" in second.json()["error"]["message"]
    assert tool.calls == [{"target": "x"}]


def test_an_approval_allows_that_call_only_not_other_arguments(
    stack: Stack, tool: Recorder, clock: Clock, api_key: str
) -> None:
    step = held(stack, api_key, "x")
    stack.model.replies = [call({"target": "y"})]
    body = decide(stack, api_key, step["approval_id"], {"approve": True}).json()
    assert body["finish_reason"] == "approval_required" and tool.calls == []
    again = body["steps"][-1]
    assert again["arguments"] == {"target": "y"} and again["approval_id"] != step["approval_id"]


def test_denying_continues_the_run_with_the_denial_as_the_observation(
    stack: Stack, tool: Recorder, clock: Clock, api_key: str
) -> None:
    step = held(stack, api_key)
    stack.model.requests.clear()
    stack.model.replies = [call({"target": "x"}), "I did not act."]
    resp = decide(stack, api_key, step["approval_id"], {"approve": False})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["answer"] == "I did not act." and body["decision"] == "denied" and tool.calls == []
    observation = next(s for s in body["steps"] if s.get("kind") == "observation")
    assert not observation["ok"] and "denied" in observation["text"]
    # the model read the denial as the call's result
    tool_msgs = [m for m in stack.model.requests[-1]["messages"] if m["role"] == "tool"]
    assert "denied" in tool_msgs[-1]["content"]


def test_a_decision_after_expiry_is_410_naming_when(
    stack: Stack, tool: Recorder, clock: Clock, api_key: str
) -> None:
    step = held(stack, api_key)
    clock.ahead = 59.0
    listed = httpx.get(f"{stack.url}/v1/agents/approvals", headers=auth(api_key)).json()["data"]
    assert [p["approval_id"] for p in listed] == [step["approval_id"]]
    clock.ahead = 61.0
    assert httpx.get(f"{stack.url}/v1/agents/approvals", headers=auth(api_key)).json()["data"] == []
    resp = decide(stack, api_key, step["approval_id"], {"approve": True})
    assert resp.status_code == 410, resp.text
    error = resp.json()["error"]
    assert error["code"] == "approval_expired"
    expired = time.strftime("%Y-%m-%dT%H:%M", time.gmtime(step["expires_at"]))
    assert f"expired at {expired}" in error["message"]
    assert tool.calls == []


def test_another_tenants_or_another_keys_approval_is_404(
    stack: Stack, tool: Recorder, clock: Clock, keys: tuple[str, str], other_key: str
) -> None:
    admin, member = keys
    step = held(stack, member)
    for key in (other_key, admin):
        resp = decide(stack, key, step["approval_id"], {"approve": True})
        assert resp.status_code == 404, resp.text
        assert httpx.get(f"{stack.url}/v1/agents/approvals", headers=auth(key)).json()["data"] == []
    assert decide(stack, member, "apr_" + "0" * 24, {"approve": True}).status_code == 404
    assert tool.calls == []
    # still pending for its owner
    stack.model.replies = [call({"target": "x"}), "ok"]
    assert decide(stack, member, step["approval_id"], {"approve": True}).status_code == 200
    assert tool.calls == [{"target": "x"}]


@pytest.mark.parametrize("body", [{"approve": "true"}, {"approve": 1}, {}, {"approve": True, "extra": 1}])
def test_the_decision_is_a_strict_boolean(
    stack: Stack, tool: Recorder, clock: Clock, api_key: str, body: dict[str, Any]
) -> None:
    step = held(stack, api_key)
    resp = decide(stack, api_key, step["approval_id"], body)
    assert resp.status_code in (400, 422), resp.text
    assert tool.calls == []
    pending = httpx.get(f"{stack.url}/v1/agents/approvals", headers=auth(api_key)).json()["data"]
    assert step["approval_id"] in [p["approval_id"] for p in pending]


def test_the_continued_run_streams_as_sse(stack: Stack, tool: Recorder, clock: Clock, api_key: str) -> None:
    step = held(stack, api_key)
    stack.model.replies = [call({"target": "x"}), "streamed"]
    with httpx.stream(
        "POST",
        f"{stack.url}/v1/agents/approvals/{step['approval_id']}",
        json={"approve": True, "stream": True},
        headers=auth(api_key),
        timeout=30,
    ) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    assert "".join(e["text"] for e in events if e["type"] == "token") == "streamed"
    assert events[-1]["type"] == "done" and tool.calls == [{"target": "x"}]
