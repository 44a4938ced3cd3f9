"""Tool calling shared by the engines and the serving layer: rendering tools into a prompt,
the grammar that forces a call, and parsing calls out of the generated text.

Rendering: a chat template that formats tools itself (``apply_chat_template(tools=...)``
changes the prompt) is used as is; a call history it leaves out (Granite 3's template writes
only ``content``) goes into the assistant's content in the family's own format. Otherwise
(SmolLM2's and Gemma 3's templates ignore ``tools``) the fallback adds a system message
listing the tools as JSON and asking for a call in the family's prompted format: one JSON
object ``{"name": ..., "arguments": {...}}`` (a JSON array of such objects for several calls),
or for Gemma the Python-style calls of its function-calling guide; assistant ``tool_calls`` in
the history are rendered in that same format and tool results become user messages naming
the call they answer.

Parsing is each family's (``tool_formats``: Qwen's ``<tool_call>`` blocks, Llama 3's JSON,
Granite's ``<|tool_call|>``, Gemma's calls, the default JSON), and always reads the default
format too, which is what a forced call is generated in.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, NotRequired, TypedDict

from services.common.openai_wire import ToolCall
from services.inference.engine.tool_formats import DEFAULT, ToolFormat
from services.inference.engine.types import InvalidParams, MessageToolCall, PromptMessage

FALLBACK_INSTRUCTIONS = (
    "You can call these tools (JSON Schema of each one's arguments):\n{tools}\n"
    'To call a tool, answer with only a JSON object {{"name": <tool name>, "arguments": <arguments object>}} '
    "(a JSON array of such objects to call several). Otherwise answer normally."
)

# Gemma's templates have no tool format: its function-calling guide prompts for Python-style calls
GEMMA_INSTRUCTIONS = (
    "You have access to these functions (JSON Schema of each one's arguments):\n{tools}\n"
    "To call functions, answer with only a list of calls written as in Python, "
    "[function_name(argument_name=value, ...), ...]. Otherwise answer normally."
)

MAX_PARALLEL_CALLS = 8


class TemplateMessage(TypedDict):
    """A message as Hugging Face chat templates read it (``apply_chat_template``'s ``messages``)."""

    role: str
    content: str
    name: NotRequired[str]
    tool_calls: NotRequired[list[dict[str, Any]]]  # OpenAI's call objects, arguments as objects
    tool_call_id: NotRequired[str]


class TemplateOptions(TypedDict, total=False):
    """The keyword arguments of ``apply_chat_template`` beside the messages."""

    tools: list[dict[str, Any]]  # the request's tools, as OpenAI's tool objects


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function", tool)
    return fn if isinstance(fn, dict) else {}


def _arguments_dict(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def chat_template_input(
    messages: Sequence[PromptMessage],
    tools: list[dict[str, Any]] | None,
    renders_tools: Callable[[], bool],
    fmt: ToolFormat = DEFAULT,
    renders_calls: Callable[[], bool] | None = None,
) -> tuple[list[TemplateMessage], TemplateOptions]:
    """The messages and keyword arguments of ``apply_chat_template`` for a chat request: the
    ``developer`` role as ``system``, content as text, and the tools and any call history
    rendered natively when ``renders_tools()`` (asked only then) or through the fallback, in
    the model family's format ``fmt``. ``renders_calls()`` (asked only for a call history):
    whether the template writes an assistant's ``tool_calls`` itself."""
    if not messages:
        raise InvalidParams("messages must not be empty", "messages")
    # every message's content is checked, also where the rendering leaves it out
    texts = [m.text() for m in messages]
    roles = ["system" if m.role == "developer" else m.role for m in messages]
    if not (tools or any(m.tool_calls or m.role == "tool" for m in messages)):
        return [TemplateMessage(role=r, content=t) for r, t in zip(roles, texts, strict=True)], {}
    if renders_tools():
        history = any(m.tool_calls for m in messages)
        inline = fmt if history and renders_calls is not None and not renders_calls() else None
        return _native(messages, roles, texts, inline), ({"tools": tools} if tools else {})
    return _fallback(messages, roles, texts, tools or [], fmt), {}


def _native(
    messages: Sequence[PromptMessage], roles: list[str], texts: list[str], inline: ToolFormat | None
) -> list[TemplateMessage]:
    """Messages as Hugging Face chat templates expect them: tool-call arguments as objects;
    with ``inline`` (a template that leaves calls out), the calls in the content instead."""
    out = []
    for m, role, text in zip(messages, roles, texts, strict=True):
        calls = m.tool_calls
        if inline is not None and calls:
            text = "\n".join(t for t in (text, _call_text(calls, inline)) if t)
            calls = None
        entry = TemplateMessage(role=role, content=text)
        if m.name is not None:
            entry["name"] = m.name
        if calls is not None:
            entry["tool_calls"] = [
                {**c.openai(), "function": {"name": c.name, "arguments": _arguments_dict(c.arguments)}}
                for c in calls
            ]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    return out


def _call_text(calls: Sequence[MessageToolCall], fmt: ToolFormat) -> str:
    return fmt.call_text([(str(c.name), _arguments_dict(c.arguments)) for c in calls])


def _fallback(
    messages: Sequence[PromptMessage],
    roles: list[str],
    texts: list[str],
    tools: list[dict[str, Any]],
    fmt: ToolFormat,
) -> list[TemplateMessage]:
    """The documented fallback for templates without a tool format (see the module doc)."""
    gemma = fmt.name == "gemma"
    style = fmt if gemma else DEFAULT  # the format the instructions below ask for
    listing = "\n".join(json.dumps(_function(t)) for t in tools)
    system = (GEMMA_INSTRUCTIONS if gemma else FALLBACK_INSTRUCTIONS).format(tools=listing)
    out: list[TemplateMessage] = []
    names: dict[str, str] = {}
    for m, role, text in zip(messages, roles, texts, strict=True):
        if role == "assistant" and m.tool_calls:
            for c in m.tool_calls:
                names[str(c.id)] = str(c.name)
            out.append({"role": "assistant", "content": _call_text(m.tool_calls, style)})
        elif role == "tool":
            call_id = m.tool_call_id or ""
            name = names.get(call_id, m.name or "the tool")
            result = f"```tool_output\n{text}\n```" if gemma else text
            out.append({"role": "user", "content": f"Result of {name} (call {call_id}): {result}"})
        else:
            out.append({"role": role, "content": text})
    if gemma:
        out = _alternating(out)
    if not tools:  # only a call history to render
        return out
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content'] or ''}\n\n{system}".strip()}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out


def _alternating(messages: list[TemplateMessage]) -> list[TemplateMessage]:
    """Consecutive messages of one role joined into one: Gemma's template refuses a history
    whose user and model turns do not alternate (tool results are user turns here)."""
    out: list[TemplateMessage] = []
    for m in messages:
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {"role": m["role"], "content": f"{out[-1]['content']}\n\n{m['content']}"}
        else:
            out.append(m)
    return out


def _closed(parameters: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters with no arguments beyond its properties unless it allows them: an
    open object let SmolLM2 append keys copied from the schema ("exclusiveMaximumNonNegativeIntegers")
    until max_tokens cut the call. Output valid here is valid against the function's own schema."""
    if parameters.get("type") == "object" and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters


def call_schema(tools: list[dict[str, Any]], name: str | None, parallel: bool) -> dict[str, Any]:
    """JSON Schema of the output when a call is forced: one call of ``name`` (or of any tool),
    or with ``parallel`` a non-empty array of calls; arguments follow each function's schema."""
    chosen = [t for t in tools if name is None or _function(t).get("name") == name]
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": _function(t)["name"]},
                "arguments": _closed(_function(t).get("parameters") or {"type": "object"}),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    one: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    if parallel and name is None:
        # bounded so a forced answer always ends (a model never choosing "]" is cut off)
        return {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}
    return one


def parse_tool_calls(
    text: str, tools: list[dict[str, Any]], fmt: ToolFormat = DEFAULT
) -> list[ToolCall] | None:
    """The calls in ``text`` in the family's format ``fmt`` (or the default one), or None when
    it is a plain answer. Only calls of the offered tools count."""
    found = fmt.parse(text, tools)
    return found.calls if found is not None else None


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template has a tool format: rendering with a tool changes the prompt."""
    probe = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "probe_tool", "parameters": {"type": "object"}}}
    try:
        plain = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        with_tools = tokenizer.apply_chat_template(
            probe, tokenize=False, add_generation_prompt=True, tools=[tool]
        )
    except Exception:  # a template that chokes on tools has no tool format
        return False
    return plain != with_tools and "probe_tool" in str(with_tools)


def template_renders_calls(tokenizer: Any) -> bool:
    """Whether the chat template writes an assistant message's ``tool_calls`` itself (Granite
    3's writes only the content)."""
    call = {"id": "call_probe", "type": "function", "function": {"name": "probe_tool", "arguments": {}}}
    probe = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_probe", "content": "done"},
    ]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that refuses the history does not write it
        return False
    return "probe_tool" in str(text)
