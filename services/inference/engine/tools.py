"""Tool calling shared by the engines and the serving layer: rendering tools into a prompt,
the grammar that forces a call, and parsing calls out of the generated text.

Rendering: a chat template that formats tools itself (``apply_chat_template(tools=...)``
changes the prompt) is used as is. Otherwise (SmolLM2's template ignores ``tools``) the
fallback adds a system message listing the tools as JSON and asking for a call as one JSON
object ``{"name": ..., "arguments": {...}}`` (a JSON array of such objects for several
calls); assistant ``tool_calls`` in the history are rendered in that same format and tool
results become user messages naming the call they answer.

Parsing accepts that format and the Hermes/Qwen one (``<tool_call>{...}</tool_call>``
blocks), which is what templates with a native tool format make models emit.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.inference.engine.types import InvalidParams, MessageToolCall, PromptMessage

FALLBACK_INSTRUCTIONS = (
    "You can call these tools (JSON Schema of each one's arguments):\n{tools}\n"
    'To call a tool, answer with only a JSON object {{"name": <tool name>, "arguments": <arguments object>}} '
    "(a JSON array of such objects to call several). Otherwise answer normally."
)


MAX_PARALLEL_CALLS = 8


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


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
    messages: Sequence[PromptMessage], tools: list[dict[str, Any]] | None, renders_tools: Callable[[], bool]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and keyword arguments of ``apply_chat_template`` for a chat request: the
    ``developer`` role as ``system``, content as text, and the tools and any call history
    rendered natively when ``renders_tools()`` (asked only then) or through the fallback."""
    if not messages:
        raise InvalidParams("messages must not be empty", "messages")
    # every message's content is checked, also where the rendering leaves it out
    texts = [m.text() for m in messages]
    roles = ["system" if m.role == "developer" else m.role for m in messages]
    if not (tools or any(m.tool_calls or m.role == "tool" for m in messages)):
        return [{"role": r, "content": t} for r, t in zip(roles, texts, strict=True)], {}
    if renders_tools():
        return _native(messages, roles, texts), ({"tools": tools} if tools else {})
    return _fallback(messages, roles, texts, tools or []), {}


def _native(messages: Sequence[PromptMessage], roles: list[str], texts: list[str]) -> list[dict[str, Any]]:
    """Messages as Hugging Face chat templates expect them: tool-call arguments as objects."""
    out = []
    for m, role, text in zip(messages, roles, texts, strict=True):
        entry = {
            "role": role,
            "content": text,
            "name": m.name,
            "tool_calls": [
                {**c.openai(), "function": {"name": c.name, "arguments": _arguments_dict(c.arguments)}}
                for c in m.tool_calls
            ]
            if m.tool_calls is not None
            else None,
            "tool_call_id": m.tool_call_id,
        }
        out.append({k: v for k, v in entry.items() if v is not None})
    return out


def _call_text(calls: Sequence[MessageToolCall]) -> str:
    objs = [{"name": c.name, "arguments": _arguments_dict(c.arguments)} for c in calls]
    return json.dumps(objs[0] if len(objs) == 1 else objs)


def _fallback(
    messages: Sequence[PromptMessage], roles: list[str], texts: list[str], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The documented fallback for templates without a tool format (see the module doc)."""
    listing = "\n".join(json.dumps(_function(t)) for t in tools)
    system = FALLBACK_INSTRUCTIONS.format(tools=listing)
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for m, role, text in zip(messages, roles, texts, strict=True):
        if role == "assistant" and m.tool_calls:
            for c in m.tool_calls:
                names[str(c.id)] = str(c.name)
            out.append({"role": "assistant", "content": _call_text(m.tool_calls)})
        elif role == "tool":
            call_id = m.tool_call_id or ""
            name = names.get(call_id, m.name or "the tool")
            out.append({"role": "user", "content": f"Result of {name} (call {call_id}): {text}"})
        else:
            out.append({"role": role, "content": text})
    if not tools:  # only a call history to render
        return out
    if out and out[0].get("role") == "system":
        out[0] = {"role": "system", "content": f"{out[0].get('content') or ''}\n\n{system}".strip()}
    else:
        out.insert(0, {"role": "system", "content": system})
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


_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _calls_from(obj: Any, known: set[str]) -> list[ToolCall] | None:
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or item["name"] not in known:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(item["name"], json.dumps(args)))
    return calls or None


def parse_tool_calls(text: str, tools: list[dict[str, Any]]) -> list[ToolCall] | None:
    """The calls in ``text`` (the whole output is a call, or ``<tool_call>`` blocks), or None
    when it is a plain answer. Only calls of the offered tools count."""
    known = {str(_function(t).get("name")) for t in tools}
    blocks = _TAGGED.findall(text)
    if blocks:
        calls: list[ToolCall] = []
        for block in blocks:
            try:
                found = _calls_from(json.loads(block), known)
            except ValueError:
                return None
            if found is None:
                return None
            calls += found
        return calls
    stripped = text.strip()
    if stripped.startswith("```"):
        stripped = stripped.strip("`").removeprefix("json").strip()
    if not stripped or stripped[0] not in "[{":
        return None
    try:
        return _calls_from(json.loads(stripped), known)
    except ValueError:
        return None


def may_be_call(prefix: str) -> bool:
    """Whether streamed text starting with ``prefix`` may turn out to be a tool call (so the
    server holds it back instead of streaming it as content)."""
    s = prefix.lstrip()
    if not s:
        return True
    return s[0] in "[{" or any(s.startswith(t) or t.startswith(s) for t in ("```", "<tool_call>"))


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
