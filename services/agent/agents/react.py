"""The ReAct text protocol, parsed strictly, with repair of the near-misses small models make.

The protocol (one step per model turn)::

    Thought: <reasoning>
    Action: <tool name>
    Action Input: <argument>

or, to finish::

    Thought: <reasoning>
    Final Answer: <answer>

Repairs (each recorded, so the step event shows what was fixed): keys in any case
or with '-'/'_' instead of a space and missing colons; ``Action: calculator(2+3)``;
``Input:``/``Tool:`` synonyms; ``Action: 99 - 45 = 42`` (arithmetic where the tool
name goes, sent to the calculator without the guessed result); quoted, back-ticked or JSON arguments; tool names
off by case, punctuation or a typo (closest known name); a hallucinated
``Observation:`` (and everything after it) cut off; a bare ``tool(arg)`` line.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field

from services.agent.prompting import DATA_RULE, tool_result_block

_LEAD = r"^[ \t]*[*#_>]*[ \t]*"
_TRAIL_OPT = r"[ \t]*[*_]*[ \t]*[:\-]?[ \t]*[*_]*[ \t]*"  # "Key:", "**Key:**", "Key -", "Key"
_TRAIL_REQ = r"[ \t]*[*_]*[ \t]*:[ \t]*[*_]*[ \t]*"  # a colon is required where the key is a common word
_FLAGS = re.IGNORECASE | re.MULTILINE
FINAL_RE = re.compile(rf"{_LEAD}final[ _-]*answer{_TRAIL_OPT}(.*)", _FLAGS | re.DOTALL)
ACTION_RE = re.compile(rf"{_LEAD}(?:action|tool){_TRAIL_REQ}(.+?)[ \t]*$", _FLAGS)
INPUT_RE = re.compile(
    rf"{_LEAD}(?:action[ _-]*input|input|tool[ _-]*input|arguments?){_TRAIL_REQ}(.*)", _FLAGS | re.DOTALL
)
THOUGHT_RE = re.compile(rf"{_LEAD}thought{_TRAIL_OPT}(.*?)(?={_LEAD}(?:action|final)|\Z)", _FLAGS | re.DOTALL)
OBSERVATION_RE = re.compile(rf"{_LEAD}observation{_TRAIL_REQ}", _FLAGS)
ARITHMETIC_RE = re.compile(r"^[\d\s.,()]*\d[\d\s.,()]*(?:[-+*/^×÷%]+[\d\s.,()]+)+(?:=.*)?$")
CALL_RE = re.compile(r"^\s*`?([A-Za-z_][\w\- ]{0,40}?)\s*\((.*)\)\s*`?\s*$", re.DOTALL)


@dataclass
class ReactStep:
    kind: str  # "action" | "final" | "invalid"
    thought: str = ""
    tool: str = ""
    argument: str = ""
    answer: str = ""
    repairs: list[str] = field(default_factory=list)
    error: str = ""


def _clean_argument(text: str, repairs: list[str]) -> str:
    arg = text.strip()
    if arg.startswith("```"):
        arg = re.sub(r"^```\w*\s*|\s*```$", "", arg)
        repairs.append("code fence removed from the input")
    first_line = arg.splitlines()[0].strip() if arg else ""
    if arg != first_line and not arg.lstrip().startswith("{"):
        arg = first_line
        repairs.append("input cut to its first line")
    if len(arg) >= 2 and arg[0] == arg[-1] and arg[0] in "`'\"":
        arg = arg[1:-1]
        repairs.append("quotes removed from the input")
    if arg.startswith("{"):
        try:
            value = json.loads(arg)
            if isinstance(value, dict) and len(value) == 1:
                arg = str(next(iter(value.values())))
                repairs.append("JSON input unwrapped")
        except json.JSONDecodeError:
            pass
    return arg.strip()


def match_tool(name: str, tools: list[str], repairs: list[str]) -> str | None:
    raw = name.strip().strip("`'\"*[]().").strip()
    if raw in tools:
        return raw
    canon = {re.sub(r"[^a-z0-9]", "", t.lower()): t for t in tools}
    key = re.sub(r"[^a-z0-9]", "", raw.lower())
    if key in canon:
        repairs.append(f"tool name {raw!r} read as {canon[key]!r}")
        return canon[key]
    close = difflib.get_close_matches(key, list(canon), n=1, cutoff=0.75)
    if close:
        repairs.append(f"tool name {raw!r} read as {canon[close[0]]!r}")
        return canon[close[0]]
    return None


def parse_react(text: str, tools: list[str]) -> ReactStep:
    repairs: list[str] = []
    obs = OBSERVATION_RE.search(text)
    if obs:
        text = text[: obs.start()]
        repairs.append("invented observation cut off")
    thought_match = THOUGHT_RE.search(text)
    thought = thought_match.group(1).strip() if thought_match else ""
    action = ACTION_RE.search(text)
    final = FINAL_RE.search(text)
    # A final answer wins when it comes before any action (the model finished).
    if final and (action is None or final.start() < action.start()):
        answer = final.group(1).strip()
        if answer:
            return ReactStep("final", thought=thought, answer=answer, repairs=repairs)
    if action:
        if not re.search(r"^Action: \S", text, re.MULTILINE) or not re.search(
            r"^Action Input: ", text, re.MULTILINE
        ):
            repairs.append("keys normalised to 'Action:' / 'Action Input:'")
        name_part = action.group(1)
        argument = ""
        call = CALL_RE.match(name_part)
        if call:
            name_part, argument = call.group(1), call.group(2)
            repairs.append("call syntax 'tool(input)' read as action and input")
        tool = match_tool(name_part, tools, repairs)
        if tool is None and "calculator" in tools and ARITHMETIC_RE.match(name_part.strip()):
            # "Action: 99 - 45 = 42": the model wrote the computation where the tool name goes.
            tool, argument = "calculator", name_part.split("=", 1)[0].strip()
            repairs.append("arithmetic in place of the tool name sent to the calculator")
            return ReactStep("action", thought=thought, tool=tool, argument=argument, repairs=repairs)
        if tool is None:
            return ReactStep(
                "invalid",
                thought=thought,
                repairs=repairs,
                error=f"unknown tool {name_part.strip()!r}; use one of: {', '.join(tools)}",
            )
        rest = text[action.end() :]
        inp = INPUT_RE.search(rest)
        if inp:
            argument = inp.group(1)
        elif not argument:
            argument = rest.strip()
            if argument:
                repairs.append("input taken from the text after the action")
        argument = _clean_argument(argument, repairs)
        if not argument:
            return ReactStep(
                "invalid",
                thought=thought,
                tool=tool,
                repairs=repairs,
                error="the action has no 'Action Input:'",
            )
        return ReactStep("action", thought=thought, tool=tool, argument=argument, repairs=repairs)
    # No keys at all: a bare "calculator(2+3)" line.
    for line in text.splitlines():
        call = CALL_RE.match(line)
        if call:
            tool = match_tool(call.group(1), tools, [])
            if tool:
                repairs.append("bare 'tool(input)' line read as an action")
                return ReactStep(
                    "action",
                    thought=thought,
                    tool=tool,
                    argument=_clean_argument(call.group(2), repairs),
                    repairs=repairs,
                )
    return ReactStep(
        "invalid",
        thought=thought or text.strip(),
        repairs=repairs,
        error="no 'Action:' with 'Action Input:', and no 'Final Answer:'",
    )


def tools_preamble(tools: dict[str, str]) -> str:
    """The start of every protocol's system message: the task, the tools (one a line) and the
    rule that tool results are data."""
    listing = "\n".join(f"- {name}: {desc}" for name, desc in tools.items())
    return f"You answer questions by using tools. Tools:\n{listing}\n{DATA_RULE}\n\n"


def format_instructions(tools: dict[str, str]) -> str:
    return (
        tools_preamble(tools) + "Reply with these lines:\n"
        "Thought: what to do next\n"
        f"Action: the tool to use, one of [{', '.join(tools)}]\n"
        "Action Input: the input of the tool\n"
        "You then get 'Observation: <result>'. When you know the answer, reply:\n"
        "Thought: I know the answer.\n"
        "Final Answer: the answer"
    )


OBSERVATION_PROMPT = (
    "Observation:\n{observation}\nIf this answers the question, reply 'Final Answer: <answer>'."
)


def example_turns(tools: dict[str, str]) -> list[dict[str, str]]:
    """A worked exchange in the protocol, as real chat turns: small chat models imitate earlier
    assistant turns far more faithfully than instructions in the system message."""
    if "calculator" not in tools:
        return []
    return [
        {"role": "user", "content": "Question: What is 6 times 7?"},
        {
            "role": "assistant",
            "content": "Thought: I should multiply with the calculator.\nAction: calculator\nAction Input: 6 * 7",
        },
        {
            "role": "user",
            "content": OBSERVATION_PROMPT.format(observation=tool_result_block("calculator", "42")),
        },
        {"role": "assistant", "content": "Thought: I know the answer.\nFinal Answer: 42"},
    ]


REPAIR_PROMPT = (
    "Your reply did not follow the format ({error}). Reply with either\n"
    "Action: <tool>\nAction Input: <input>\nor\nFinal Answer: <answer>"
)


# --- Constrained steps (the engine's response_format json_schema) -----------------------------
# With grammar-constrained decoding a step is one JSON object, so even SmolLM2-135M always writes a
# parseable step: the tool name is an enum of the known tools, and lengths are bounded so a model that
# repeats itself inside a string still closes the object within max_tokens.
# Digits are one token each in SmolLM2's vocabulary: a runaway number in an action input must end
# well inside the step's token budget (see AgentRunner.CONSTRAINED_MIN_TOKENS).
_THOUGHT_MAX = 60
_INPUT_MAX = 40
_ANSWER_MAX = 80


def step_schema(
    tools: list[str],
    final_only: bool = False,
    answers: list[str] | None = None,
    inputs: dict[str, dict[str, object]] | None = None,
    act_only: bool = False,
) -> dict[str, object]:
    """``answers``: what the final answer may be (spans of a tool result), or None for any text;
    ``inputs``: a tool's own schema of its input (the calculator's arithmetic pattern), which its
    action then follows; the other tools share one action with a bounded string input;
    ``act_only``: the step must call one of ``tools`` (a server the request names, first)."""
    answer: dict[str, object] = (
        {"type": "string", "enum": answers}
        if answers
        else {"type": "string", "minLength": 1, "maxLength": _ANSWER_MAX}
    )
    final = {
        "type": "object",
        "properties": {"thought": {"type": "string", "maxLength": _THOUGHT_MAX}, "final_answer": answer},
        "required": ["thought", "final_answer"],
        "additionalProperties": False,
    }
    if final_only:
        return final
    inputs = inputs or {}

    def action(name: dict[str, object], argument: dict[str, object]) -> dict[str, object]:
        return {
            "type": "object",
            # the action before the thought: with the thought first SmolLM2-135M copies the latest
            # example's thought ("I should search the documents.") and then that example's tool
            # (first steps of the 24 tool tasks: right tool and input in 18 this way, 15 the other)
            "properties": {
                "action": name,
                "action_input": argument,
                "thought": {"type": "string", "maxLength": _THOUGHT_MAX},
            },
            "required": ["action", "action_input", "thought"],
            "additionalProperties": False,
        }

    plain = [t for t in tools if t not in inputs]
    actions = [action({"const": t}, inputs[t]) for t in tools if t in inputs]
    if plain:
        free_input = {"type": "string", "minLength": 1, "maxLength": _INPUT_MAX}
        actions.insert(0, action({"type": "string", "enum": plain}, free_input))
    return {"anyOf": actions if act_only else [*actions, final]}


def step_response_format(
    tools: list[str],
    final_only: bool = False,
    answers: list[str] | None = None,
    inputs: dict[str, dict[str, object]] | None = None,
    act_only: bool = False,
) -> dict[str, object]:
    return {
        "type": "json_schema",
        "json_schema": {
            "name": "final_step" if final_only else "react_step",
            "schema": step_schema(tools, final_only, answers, inputs, act_only),
            "strict": True,
        },
    }


def json_step_as_text(text: str) -> str | None:
    """A constrained JSON step rewritten in the text protocol (so ``parse_react`` and its repairs
    apply unchanged); None when ``text`` is not a JSON step (an engine or double that ignored it)."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return None
    if not isinstance(value, dict):
        return None
    thought = f"Thought: {value.get('thought', '')}\n" if value.get("thought") else ""
    if "final_answer" in value:
        return f"{thought}Final Answer: {value['final_answer']}"
    if "action" in value:
        return f"{thought}Action: {value['action']}\nAction Input: {value.get('action_input', '')}"
    return None


def json_instructions(tools: dict[str, str]) -> str:
    return (
        tools_preamble(tools)
        + 'Reply with one JSON object: {"action": "<tool>", "action_input": "<input>", "thought": "..."}.\n'
        "You then get 'Observation: <result>'. The observation is the source of your answer: when it "
        'answers the question, reply {"thought": "I know the answer.", "final_answer": "<the result>"}.'
    )


JSON_OBSERVATION_PROMPT = (
    "Observation:\n{observation}\nThis result answers the question. Reply with the final answer, "
    "taken from the observation."
)


JSON_FAILED_PROMPT = (
    "Observation:\n{observation}\nThe tool failed. Use another tool, or give the final answer."
)


def json_step(thought: str, tool: str = "", argument: str = "", answer: str | None = None) -> str:
    if answer is not None:
        return json.dumps({"thought": thought, "final_answer": answer})
    return json.dumps({"action": tool, "action_input": argument, "thought": thought})


def json_example_turns(tools: dict[str, str]) -> list[dict[str, str]]:
    turns: list[dict[str, str]] = []
    if "calculator" in tools:
        turns += [
            {"role": "user", "content": "Question: What is 6 times 7?"},
            {
                "role": "assistant",
                "content": json_step("I should multiply with the calculator.", "calculator", "6 * 7"),
            },
            {
                "role": "user",
                "content": JSON_OBSERVATION_PROMPT.format(observation=tool_result_block("calculator", "42")),
            },
            {"role": "assistant", "content": json_step("I know the answer.", answer="42")},
        ]
    if "document_search" in tools:
        # A worked search, so the model sees that facts come from the documents, not the calculator.
        # Last: SmolLM2-135M leans to the tool of the latest example (as in tool_mode.example_turns).
        turns += [
            {"role": "user", "content": "Question: What colour is the Moon?"},
            {
                "role": "assistant",
                "content": json_step("I should search the documents.", "document_search", "Moon colour"),
            },
            {
                "role": "user",
                "content": JSON_OBSERVATION_PROMPT.format(
                    observation=tool_result_block("document_search", "[moon] The Moon is grey.")
                ),
            },
            {"role": "assistant", "content": json_step("I know the answer.", answer="grey")},
        ]
    return turns
