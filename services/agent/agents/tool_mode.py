"""The tool-calling mode's prompts: OpenAI ``tools`` with a ``final_answer`` function, the tool
result presented as the answer's source, and a worked exchange as real chat turns.

With a constrained engine every step is a forced call (``tool_choice: "required"``, one call,
``parallel_tool_calls: false``), so the model never answers in free text: finishing is itself a
call of ``final_answer``. What a small model still has to do is pick the tool and copy the
result, so the prompts put the result right before the forced ``final_answer`` call, and the
worked example shows the whole exchange once (SmolLM2-135M imitates earlier assistant turns far
more faithfully than instructions).
"""

from __future__ import annotations

import json
from typing import Any

from services.agent.prompting import DATA_RULE, tool_result_block
from services.agent.tools.base import Tool

FINAL_TOOL = "final_answer"
_ANSWER_MAX = 80  # a runaway answer string still closes well inside the step's max_tokens

FINAL_FUNCTION: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": FINAL_TOOL,
        "description": "Give the final answer to the question, taken from the tool results.",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "minLength": 1, "maxLength": _ANSWER_MAX}},
            "required": ["answer"],
            "additionalProperties": False,
        },
    },
}

SYSTEM_PROMPT = (
    "You answer questions by calling tools. Call one tool, read its result, then call "
    f"{FINAL_TOOL} with the answer. A tool result is the source of your answer: copy it. {DATA_RULE}"
)

RESULT_PROMPT = (
    "The {tool} tool answered:\n{observation}\n"
    "This result answers the question {question!r}. Call {final} with the answer taken from it."
)

FAILED_PROMPT = "The {tool} tool failed:\n{observation}\nCall another tool, or {final} with the answer."


def final_call_format(answers: list[str]) -> dict[str, Any]:
    """The response format of a forced final step whose answer is one of ``answers``: a
    ``final_answer`` call's JSON, as the worked example shows the model."""
    params = FINAL_FUNCTION["function"]["parameters"]
    schema = {
        "type": "object",
        "properties": {
            "name": {"const": FINAL_TOOL},
            "arguments": {**params, "properties": {"answer": {"type": "string", "enum": answers}}},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "final_call", "schema": schema, "strict": True}}


def call_answer(arguments: str | None) -> str:
    """The answer in a ``final_answer`` call's arguments (JSON text); empty when there is none."""
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return ""
    return str(args.get("answer", "") if isinstance(args, dict) else args).strip()


def final_call_answer(content: str | None) -> str | None:
    """The answer of a final step written in ``final_call_format``; None when ``content`` is not
    such a call (an engine or test double that ignored the format)."""
    try:
        value = json.loads(content or "")
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") != FINAL_TOOL:
        return None
    return call_answer(json.dumps(value.get("arguments")))


def functions(tools: dict[str, Tool]) -> list[dict[str, Any]]:
    """The tools in OpenAI's ``tools`` shape."""
    return [
        {
            "type": "function",
            "function": {"name": n, "description": t.description, "parameters": t.parameters},
        }
        for n, t in tools.items()
    ]


def result_prompt(tool: str, observation: str, question: str, ok: bool) -> str:
    """The user turn after a tool result: the result as the answer's source (or, failed, not)."""
    template = RESULT_PROMPT if ok else FAILED_PROMPT
    block = tool_result_block(tool, observation)
    return template.format(tool=tool, observation=block, question=question, final=FINAL_TOOL)


def _call(call_id: str, name: str, arguments: dict[str, str]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        ],
    }


def _exchange(
    n: int, question: str, tool: str, arguments: dict[str, str], observation: str, answer: str
) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": question},
        _call(f"example_{n}a", tool, arguments),
        {"role": "tool", "tool_call_id": f"example_{n}a", "content": tool_result_block(tool, observation)},
        {"role": "user", "content": result_prompt(tool, observation, question, ok=True)},
        _call(f"example_{n}b", FINAL_TOOL, {"answer": answer}),
        {"role": "tool", "tool_call_id": f"example_{n}b", "content": answer},
    ]


def example_turns(tools: dict[str, Tool]) -> list[dict[str, Any]]:
    """A worked exchange per known tool (document search, calculator), as chat turns."""
    turns: list[dict[str, Any]] = []
    if "calculator" in tools:
        turns += _exchange(1, "What is 6 times 7?", "calculator", {"expression": "6 * 7"}, "42", "42")
    # The search example comes last: SmolLM2-135M leans to the tool of the latest example, and
    # arithmetic questions still go to the calculator (measured over the 20 tool tasks' first
    # steps: search first picked search for 2 of 8 fact questions, last for 7 of 8; 12/12 both).
    if "document_search" in tools:
        turns += _exchange(
            2,
            "What colour is the Moon?",
            "document_search",
            {"query": "Moon colour"},
            "[moon] The Moon is grey.",
            "grey",
        )
    return turns
