"""Tool calls in each model family's own format: which family a model writes, how its calls
are read from the generated text (whole or streamed), and how a call history is written back
in that format when the chat template does not write it itself.

| format | families | a call as the model writes it |
|---|---|---|
| ``hermes`` | Qwen2.5, Qwen3, Granite 4.0 (and templates with the same markers) | ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call, text before them is content |
| ``llama3`` | Llama 3.1-3.3 | ``{"name": ..., "parameters": {...}}``, also after ``<|python_tag|>``, several separated by ``;`` |
| ``granite`` | Granite 3.x | ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`` |
| ``gemma`` | Gemma 3 | the Python-style calls of Gemma's function-calling guide, ``[name(arg=value, ...), ...]``, also inside a ```` ```tool_code ```` block |
| ``json`` | the default (SmolLM2 and templates without a tool format) | one JSON object ``{"name": ..., "arguments": {...}}`` or an array of them |

Every format also reads the default one: a call forced by ``tool_choice`` is generated under
the JSON grammar of ``tools.call_schema``, whatever the family.

The family is chosen from the chat template's markers (the template the model was trained
with, from its tokenizer folder or its GGUF's ``tokenizer.chat_template``, which transformers
reads into the tokenizer), else from the config's ``model_type`` (a GGUF's architecture);
``select`` says which and why, for the engine's log and ``/health``.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.openai_wire import ToolCall

# (format, marker in the chat template): the first that the template holds decides
TEMPLATE_MARKERS = (
    ("granite", "<|tool_call|>"),
    ("hermes", "<tool_call>"),
    ("llama3", "<|python_tag|>"),
    ("llama3", '"parameters": dictionary of argument name'),
    # Gemma's template has no tool format, but its turns are Gemma's own
    ("gemma", "<start_of_turn>"),
)
# a template without markers: the family its model_type names
MODEL_TYPES = {
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "granite": "granite",
    # Granite 4.0 writes its calls in <tool_call> tags, as Qwen does
    "granitemoehybrid": "hermes",
    "gemma3": "gemma",
    "gemma3_text": "gemma",
}


@dataclass(frozen=True)
class Parsed:
    """The calls found in an output, and the content the model wrote before them."""

    calls: list[ToolCall]
    content: str


def _arguments(raw: Any) -> str | None:
    """The arguments as JSON text (an object), or None when they are not an object."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return None
    return json.dumps(raw) if isinstance(raw, dict) else None


def _calls_from(obj: Any, known: set[str]) -> list[ToolCall] | None:
    """Calls from decoded JSON: an object with ``name`` and ``arguments`` (or Llama's
    ``parameters``), or a list of them; None unless every one is a call of an offered tool."""
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or item["name"] not in known:
            return None
        args = _arguments(item.get("arguments", item.get("parameters", {})))
        if args is None:
            return None
        calls.append(ToolCall.of(item["name"], args))
    return calls or None


def _json_calls(text: str, known: set[str]) -> list[ToolCall] | None:
    try:
        return _calls_from(json.loads(text), known)
    except ValueError:
        return None


def _whole_json(text: str, known: set[str]) -> list[ToolCall] | None:
    """The default format: the whole output is a call (or a list), also in a fenced block."""
    stripped = text.strip()
    if stripped.startswith("```"):
        stripped = stripped.strip("`").removeprefix("json").strip()
    if not stripped or stripped[0] not in "[{":
        return None
    return _json_calls(stripped, known)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _hermes(text: str, known: set[str]) -> Parsed | None:
    start = text.find("<tool_call>")
    if start < 0:
        return None
    calls: list[ToolCall] = []
    for block in _HERMES.findall(text[start:]):
        found = _json_calls(block, known)
        if found is None:
            return None
        calls += found
    return Parsed(calls, text[:start]) if calls else None


def _json_sequence(text: str) -> list[Any] | None:
    """JSON values one after another, separated by ``;`` or whitespace (Llama 3's several calls)."""
    decoder, pos = json.JSONDecoder(), 0
    values: list[Any] = []
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos == len(text):
            return values or None
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)


def _llama3(text: str, known: set[str]) -> Parsed | None:
    start = text.find("<|python_tag|>")
    body = text[start + len("<|python_tag|>") :] if start >= 0 else text.strip()
    if start < 0 and not body.startswith("{"):
        return None
    values = _json_sequence(body)
    if values is None:
        return None
    calls: list[ToolCall] = []
    for value in values:
        found = _calls_from(value, known)
        if found is None:
            return None
        calls += found
    return Parsed(calls, text[: max(start, 0)])


def _granite(text: str, known: set[str]) -> Parsed | None:
    start = text.find("<|tool_call|>")
    if start < 0:
        return None
    found = _json_calls(text[start + len("<|tool_call|>") :].strip(), known)
    return Parsed(found, text[:start]) if found else None


_TOOL_CODE = re.compile(r"```(?:tool_code|python)?\s*\n?(.*?)\s*(?:```|$)", re.DOTALL)


def _python_calls(source: str, known: set[str]) -> list[ToolCall] | None:
    """``[name(arg=value, ...), ...]`` or one bare call, with literal keyword arguments only."""
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError:
        return None
    nodes = tree.body.elts if isinstance(tree.body, ast.List) else [tree.body]
    calls = []
    for node in nodes:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in known):
            return None
        if node.args or any(k.arg is None for k in node.keywords):
            return None  # positional or ** arguments have no names to map to the schema
        try:
            args = {str(k.arg): ast.literal_eval(k.value) for k in node.keywords}
        except ValueError:
            return None
        calls.append(ToolCall.of(node.func.id, json.dumps(args)))
    return calls or None


def _gemma(text: str, known: set[str]) -> Parsed | None:
    fence = text.find("```")
    if fence >= 0:
        block = _TOOL_CODE.match(text, fence)
        found = _python_calls(block.group(1), known) if block else None
        return Parsed(found, text[:fence]) if found else None
    found = _python_calls(text, known)
    return Parsed(found, "") if found else None


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call format (see the module doc)."""

    name: str
    # text that starts a call anywhere in the output (content before it streams as content)
    markers: tuple[str, ...]
    # text that starts a call only at the output's start (a call that is the whole output)
    openers: tuple[str, ...]
    # whether a bare ``name(`` of an offered tool opens a call (Gemma's Python-style calls)
    python_calls: bool = False

    def parse(self, text: str, tools: list[dict[str, Any]]) -> Parsed | None:
        """The calls in ``text`` and the content before them, or None for a plain answer.
        Only calls of the offered tools count."""
        known = tool_names(tools)
        family = {"hermes": _hermes, "llama3": _llama3, "granite": _granite, "gemma": _gemma}.get(self.name)
        found = family(text, known) if family is not None else None
        if found is None and self.name != "hermes":
            # the default format's tagged blocks have always been read, for any model
            found = _hermes(text, known)
        if found is None:
            calls = _whole_json(text, known)
            found = Parsed(calls, "") if calls else None
        return found

    def content_end(self, text: str, at_start: bool, names: Iterable[str]) -> int:
        """How much of ``text`` (the output not yet streamed; ``at_start``: from its
        beginning) is content for sure, so that a server may stream it while holding back
        what may turn out to be a call."""
        if at_start and self.may_open(text, names):
            return 0
        cut = len(text)
        for marker in self.markers:
            found = text.find(marker)
            if found >= 0:
                cut = min(cut, found)
                continue
            # a marker's beginning at the end of the text is held until it can be told apart
            for k in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:k]):
                    cut = min(cut, len(text) - k)
                    break
        return cut

    def may_open(self, text: str, names: Iterable[str]) -> bool:
        """Whether an output starting with ``text`` may turn out to be a call."""
        s = text.lstrip()
        if not s:
            return True
        if s[0] in "[{":
            return True
        prefixes = (*self.openers, *self.markers)
        if any(s.startswith(p) or p.startswith(s) for p in prefixes):
            return True
        if self.python_calls:
            return any(s.startswith(f"{n}(") or f"{n}(".startswith(s) for n in names)
        return False

    def call_text(self, calls: Sequence[tuple[str, Any]]) -> str:
        """A call history (name, arguments object) as this family writes it, for a template
        that leaves the calls out or has no tool format."""
        if self.name == "gemma":
            body = ", ".join(
                f"{name}({', '.join(f'{k}={v!r}' for k, v in (args if isinstance(args, dict) else {}).items())})"
                for name, args in calls
            )
            return f"```tool_code\n[{body}]\n```"
        key = "parameters" if self.name == "llama3" else "arguments"
        objs = [{"name": name, key: args} for name, args in calls]
        if self.name == "hermes":
            return "\n".join(f"<tool_call>\n{json.dumps(o)}\n</tool_call>" for o in objs)
        if self.name == "granite":
            return "<|tool_call|>" + json.dumps(objs)
        if self.name == "llama3":
            return "; ".join(json.dumps(o) for o in objs)
        return json.dumps(objs[0] if len(objs) == 1 else objs)


FORMATS = {
    "json": ToolFormat("json", markers=("<tool_call>",), openers=("```",)),
    "hermes": ToolFormat("hermes", markers=("<tool_call>",), openers=("```",)),
    "llama3": ToolFormat("llama3", markers=("<|python_tag|>",), openers=("```",)),
    "granite": ToolFormat("granite", markers=("<|tool_call|>", "<tool_call>"), openers=("```",)),
    "gemma": ToolFormat("gemma", markers=("```tool_code",), openers=("```",), python_calls=True),
}
DEFAULT = FORMATS["json"]


def tool_names(tools: list[dict[str, Any]]) -> set[str]:
    names = set()
    for tool in tools:
        fn = tool.get("function", tool)
        if isinstance(fn, dict):
            names.add(str(fn.get("name")))
    return names


def select(model_type: str | None, template: Any) -> tuple[ToolFormat, str]:
    """The tool-call format of a model, and why: its chat template's markers first, then its
    ``model_type``, else the default."""
    texts = template.values() if isinstance(template, dict) else [template]
    text = "\n".join(t for t in texts if isinstance(t, str))
    for name, marker in TEMPLATE_MARKERS:
        if marker in text:
            return FORMATS[name], f"the chat template writes {marker!r}"
    if model_type in MODEL_TYPES:
        return FORMATS[MODEL_TYPES[model_type]], f"model_type {model_type!r}"
    return DEFAULT, "no tool format in the chat template nor the model_type: the default JSON format"
