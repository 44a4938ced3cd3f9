"""The agent loop against a scripted test-double model (OpenAI wire format over real HTTP)."""

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from services.agent.agents.runner import AgentRunner
from services.agent.clients import InferenceClient
from services.agent.tools.base import ToolContext
from services.agent.tools.calculator import Calculator
from services.common.errors import InvalidRequest
from tests.agent.doubles import FailingTool, Refusal, ScriptedModel, inference_double
from tests.helpers.servers import serve_app

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[ScriptedModel, str]]:
    model = ScriptedModel()
    with serve_app(inference_double(model)) as url:
        yield model, url


class Hanging:
    name = "hang"
    description = "Never answers."
    parameters: ClassVar[dict[str, Any]] = {}

    async def run(self, argument: Any, ctx: ToolContext) -> str:
        await asyncio.sleep(3600)
        return "never"


class SyncHanging(Hanging):
    name = "synchang"

    def run(self, argument: Any, ctx: ToolContext) -> str:  # type: ignore[override]
        time.sleep(2)
        return "late"


def runner(url: str, **kw: Any) -> AgentRunner:
    tools = {
        "calculator": Calculator(),
        "explode": FailingTool("explode", RuntimeError("kaboom")),
        "hang": Hanging(),
        "synchang": SyncHanging(),
    }
    return AgentRunner(InferenceClient(url, "k"), "scripted", tools, ToolContext(), **kw)


async def events_of(r: AgentRunner, question: str, mode: str = "react") -> list[dict[str, Any]]:
    return [e async for e in r.run(question, [], mode=mode)]


async def test_calculator_task_with_repairs(scripted: tuple[ScriptedModel, str]) -> None:
    model, url = scripted
    model.requests.clear()
    model.replies = [
        "I am not sure.",  # no protocol at all: the loop asks again
        "Thought: multiply them\n**Action:** calcualtor\nAction Input: `17 * 23`\nObservation: 400",
        "Thought: I know the answer\nFinal Answer: 391",
    ]
    # The text protocol without the engine's constraints (an upstream that refuses response_format).
    r = runner(url, constrained=False)
    events = await events_of(r, "What is 17 times 23?")
    steps = [(e["kind"], e.get("tool")) for e in events if e["type"] == "step"]
    assert steps == [
        ("thought", None),
        ("thought", None),
        ("tool_call", "calculator"),
        ("observation", "calculator"),
        ("thought", None),
        ("final", None),
    ]
    call = next(e for e in events if e.get("kind") == "tool_call")
    assert call["input"] == "17 * 23" and call["repairs"]
    assert next(e for e in events if e.get("kind") == "observation")["text"] == "391"
    assert r.result.answer == "391" and events[-1] == {"type": "token", "text": "391"}
    # The model saw the format reminder, then its own step rewritten strictly, then the real observation.
    assert "did not follow the format" in model.requests[1]["messages"][-1]["content"]
    last = model.requests[2]["messages"]
    assert last[-2]["content"] == "Thought: multiply them\nAction: calculator\nAction Input: 17 * 23"
    assert last[-1]["content"].startswith(
        'Observation:\n<tool_result name="calculator">\n391\n</tool_result>\n'
    )
    assert model.requests[0]["messages"][1]["content"] == "Question: What is 6 times 7?"  # the worked example
    assert model.requests[0]["stop"]


async def test_failing_and_hanging_tools_become_observations(scripted: tuple[ScriptedModel, str]) -> None:
    model, url = scripted
    model.replies = [
        "Action: explode\nAction Input: now",
        "Action: hang\nAction Input: forever",
        "Action: synchang\nAction Input: forever",
        "Final Answer: tools are broken",
    ]
    r = runner(url, tool_timeout_s=0.3)
    started = time.monotonic()
    events = await events_of(r, "use the tools")
    observations = [e for e in events if e.get("kind") == "observation"]
    assert [o["ok"] for o in observations] == [False, False, False]
    assert "RuntimeError: kaboom" in observations[0]["text"]
    assert "did not answer within 0.3 s" in observations[1]["text"]
    assert "did not answer within 0.3 s" in observations[2]["text"]
    assert r.result.answer == "tools are broken" and time.monotonic() - started < 5


async def test_a_repeated_call_ends_with_its_observation(scripted: tuple[ScriptedModel, str]) -> None:
    model, url = scripted
    model.replies = lambda body: "Thought: multiply\nAction: calculator\nAction Input: 17 * 23"
    r = runner(url, finish_after_result=False)
    events = await events_of(r, "What is 17 times 23?")
    assert [e.get("kind") for e in events if e["type"] == "step"][-1] == "final"
    assert sum(1 for e in events if e.get("kind") == "tool_call") == 1
    assert r.result.answer == "391" and any("repeated call" in x for x in r.result.repairs)


async def test_step_budget(scripted: tuple[ScriptedModel, str]) -> None:
    model, url = scripted
    counter = iter(range(100))
    model.replies = lambda body: f"Action: calculator\nAction Input: 1+{next(counter)}"
    model.requests.clear()
    events = await events_of(runner(url, max_steps=3, finish_after_result=False), "loop forever")
    # A model that ignores the final-only constraint of the last step still ends at the budget,
    # and no tool runs on that step.
    assert events[-1]["type"] == "error" and events[-1]["code"] == "step_budget_exceeded"
    assert sum(1 for e in events if e.get("kind") == "tool_call") == 2
    assert len(model.requests) == 3


async def test_time_budget(scripted: tuple[ScriptedModel, str]) -> None:
    model, url = scripted
    model.replies = lambda body: "Action: hang\nAction Input: x"
    started = time.monotonic()
    events = await events_of(runner(url, time_budget_s=0.5, tool_timeout_s=30), "hang")
    assert events[-1]["code"] == "time_budget_exceeded" and time.monotonic() - started < 3


async def test_openai_tool_calling(scripted: tuple[ScriptedModel, str]) -> None:
    model, url = scripted
    model.requests.clear()
    model.replies = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2**10"}'},
                }
            ],
        },
        "The answer is 1024.",
    ]
    r = runner(url)
    events = await events_of(r, "2 to the 10th?", mode="openai")
    assert [e["text"] for e in events if e.get("kind") == "observation"] == ["1024"]
    assert r.result.answer == "The answer is 1024."
    assert model.requests[0]["tools"][0]["function"]["name"] == "calculator"
    assert model.requests[1]["messages"][-2] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": '<tool_result name="calculator">\n1024\n</tool_result>',
    }


async def test_tool_calling_falls_back_to_react_when_the_engine_refuses_tools(
    scripted: tuple[ScriptedModel, str],
) -> None:
    """The default mode is OpenAI tool calls; an engine that refuses them on the first step (a
    remote upstream without tool calling) gets the same run in ReAct; any other 400 still fails."""
    model, url = scripted
    model.requests.clear()
    model.replies = [
        Refusal("tools are not supported by this server", param=None),
        json.dumps({"thought": "add", "action": "calculator", "action_input": "2 + 3"}),
        json.dumps({"thought": "done", "final_answer": "5"}),
    ]
    r = runner(url)
    events = await events_of(r, "What is 2 plus 3?", mode="openai")
    assert "tools" in model.requests[0] and "tools" not in model.requests[1]
    assert "response_format" in model.requests[1]  # the ReAct step, constrained
    assert [e["kind"] for e in events if e["type"] == "step"][-1] == "final"
    assert r.result.answer == "5" and r.result.steps == 2
    model.replies = [Refusal("the prompt is too long", param="messages")]
    with pytest.raises(InvalidRequest, match="the prompt is too long"):
        await events_of(runner(url), "What is 2 plus 3?", mode="openai")


def _step(body: dict[str, Any]) -> dict[str, Any]:
    return dict(body["response_format"]["json_schema"]["schema"])


async def test_react_steps_are_constrained_and_the_last_is_a_forced_final(
    scripted: tuple[ScriptedModel, str],
) -> None:
    """Each ReAct step asks the engine for the protocol's JSON schema (tool names as an enum); the
    last step of the budget may only be a final answer, and the model then finishes with it."""
    model, url = scripted
    model.requests.clear()
    counter = iter(range(100))

    def reply(body: dict[str, Any]) -> str:
        schema = _step(body)
        if "anyOf" in schema:  # free step: keep calling the calculator with new inputs
            return json.dumps(
                {"thought": "add", "action": "calculator", "action_input": f"1+{next(counter)}"}
            )
        return json.dumps({"thought": "I know the answer.", "final_answer": "2"})

    model.replies = reply
    r = runner(url, max_steps=3, finish_after_result=False)
    events = await events_of(r, "What is 1 plus 1?")
    assert [e["kind"] for e in events if e["type"] == "step"] == [
        "thought", "tool_call", "observation", "thought", "tool_call", "observation", "thought", "final",
    ]  # fmt: skip
    assert r.result.answer == "2" and r.result.finish_reason == "stop" and r.result.steps == 3
    free, forced = _step(model.requests[0]), _step(model.requests[2])
    actions = [s for s in free["anyOf"] if "action" in s["properties"]]
    # the tools with a free string input share one action; the calculator's input follows its pattern
    assert actions[0]["properties"]["action"]["enum"] == ["explode", "hang", "synchang"]
    calc = actions[1]["properties"]
    assert calc["action"] == {"const": "calculator"} and "pattern" in calc["action_input"]
    assert list(calc) == ["action", "action_input", "thought"]  # the action before the thought
    assert set(forced["required"]) == {"thought", "final_answer"} and "action" not in forced["properties"]
    assert all("stop" not in b for b in model.requests)
    # The model saw its step as JSON and the tool result presented as the answer's source.
    seen = model.requests[1]["messages"]
    assert json.loads(seen[-2]["content"])["action_input"] == "1+0"
    assert (
        seen[-1]["content"].startswith('Observation:\n<tool_result name="calculator">\n1\n</tool_result>')
        and "from the observation" in seen[-1]["content"]
    )


def _call_reply(name: str, args: dict[str, Any], call_id: str) -> dict[str, Any]:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


@pytest.mark.parametrize("copy_answer", [True, False])
async def test_tool_calling_mode_requires_a_tool_then_forces_final_answer(
    scripted: tuple[ScriptedModel, str], copy_answer: bool
) -> None:
    """Step 1 must call a tool (one call, arguments constrained); after a good result the step may
    only finish: with copy_answer its answer is a span of the result (a final_answer call's JSON as
    the response format, listing no tools), otherwise a forced final_answer call."""
    model, url = scripted
    model.requests.clear()

    def reply(body: dict[str, Any]) -> str | dict[str, Any]:
        if body.get("tool_choice") == "required":
            return _call_reply("calculator", {"expression": "17*23"}, "c1")
        if "response_format" in body:
            return json.dumps({"name": "final_answer", "arguments": {"answer": "391"}})
        return _call_reply("final_answer", {"answer": "391"}, "c2")

    model.replies = reply
    r = runner(url, max_steps=2, copy_answer=copy_answer)
    events = await events_of(r, "What is 17 times 23?", mode="openai")
    assert [e["text"] for e in events if e.get("kind") == "observation"] == ["391"]
    assert r.result.answer == "391" and events[-1] == {"type": "token", "text": "391"}
    first, forced = model.requests
    assert first["tool_choice"] == "required"
    assert "final_answer" in [t["function"]["name"] for t in first["tools"]]
    # one call a step, its arguments closed and the calculator's held to arithmetic
    assert first["parallel_tool_calls"] is False
    calc = next(t["function"]["parameters"] for t in first["tools"] if t["function"]["name"] == "calculator")
    assert calc["additionalProperties"] is False and "pattern" in calc["properties"]["expression"]
    if copy_answer:
        assert "tools" not in forced and "tool_choice" not in forced
        schema = forced["response_format"]["json_schema"]["schema"]
        assert schema["properties"]["name"] == {"const": "final_answer"}
        assert schema["properties"]["arguments"]["properties"]["answer"]["enum"] == ["391"]
    else:
        assert forced["tool_choice"] == {"type": "function", "function": {"name": "final_answer"}}
        # only final_answer listed: no other call to imitate
        assert [t["function"]["name"] for t in forced["tools"]] == ["final_answer"]
        assert forced["parallel_tool_calls"] is False and "response_format" not in forced
    # the result is shown as the answer's source, last
    tool_msg, source = forced["messages"][-2:]
    block = '<tool_result name="calculator">\n391\n</tool_result>'
    assert tool_msg == {"role": "tool", "tool_call_id": "c1", "content": block}
    assert source["role"] == "user" and f"answered:\n{block}" in source["content"]
    assert "final_answer" in source["content"] and "17 times 23" in source["content"]
    # a worked exchange precedes the question, as chat turns the model can imitate
    shown = first["messages"]
    assert shown[-1] == {"role": "user", "content": "What is 17 times 23?"}
    example = [m for m in shown[:-1] if m.get("tool_calls")]
    assert [m["tool_calls"][0]["function"]["name"] for m in example] == ["calculator", "final_answer"]


async def test_tool_calling_mode_after_a_failed_tool_the_next_step_is_free(
    scripted: tuple[ScriptedModel, str],
) -> None:
    """A failed tool is not the answer's source: the next step may call another tool."""
    model, url = scripted
    model.requests.clear()
    calls = iter(
        [
            ("explode", {"input": "now"}),
            ("calculator", {"expression": "6*7"}),
            ("final_answer", {"answer": "42"}),
        ]
    )

    def reply(body: dict[str, Any]) -> dict[str, Any]:
        name, args = next(calls)
        return _call_reply(name, args, name)

    model.replies = reply
    r = runner(url, max_steps=4, copy_answer=False)
    await events_of(r, "What is 6 times 7?", mode="openai")
    assert r.result.answer == "42" and r.result.steps == 3
    assert [b["tool_choice"] for b in model.requests] == [
        "required",
        "required",
        {"type": "function", "function": {"name": "final_answer"}},
    ]
    failed = model.requests[1]["messages"][-1]["content"]
    assert "failed" in failed and "kaboom" in failed and "answered" not in failed


async def test_final_answer_call_ends_the_run_before_budget(scripted: tuple[ScriptedModel, str]) -> None:
    model, url = scripted
    model.requests.clear()
    call = {
        "id": "f",
        "type": "function",
        "function": {"name": "final_answer", "arguments": '{"answer": "hi"}'},
    }
    model.replies = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    r = runner(url)
    await events_of(r, "say hi", mode="openai")
    assert r.result.answer == "hi" and len(model.requests) == 1 and r.result.tool_calls == 0


async def test_a_tool_result_is_followed_by_a_forced_final_step(scripted: tuple[ScriptedModel, str]) -> None:
    """By default (small models), the step after a good tool result may only finish, and the tool
    result is shown as the answer's source; a failed tool leaves the next step free."""
    model, url = scripted
    model.requests.clear()
    model.replies = [
        json.dumps({"thought": "t", "action": "explode", "action_input": "now"}),
        json.dumps({"thought": "t", "action": "calculator", "action_input": "17 * 23"}),
        json.dumps({"thought": "done", "final_answer": "391"}),
    ]
    r = runner(url)
    await events_of(r, "What is 17 times 23?")
    assert r.result.answer == "391" and r.result.steps == 3
    schemas = [_step(b) for b in model.requests]
    assert ["anyOf" in s for s in schemas] == [True, True, False]
    # the forced final answer is a span of the good result (the failed tool's is not offered)
    assert schemas[2]["properties"]["final_answer"]["enum"] == ["391"]
    assert (
        '<tool_result name="calculator">\n391\n</tool_result>' in model.requests[2]["messages"][-1]["content"]
    )
