"""A Responses request read into chat completions' terms: input items as chat messages, flat
function tools as chat tools, ``tool_choice`` and ``text.format`` as chat's, and the chat path's
400s named by the Responses field they came from.

Input items taken: messages (``role`` user, system, developer or assistant; text, or
``input_text`` / ``output_text`` / ``refusal`` parts), ``function_call`` and
``function_call_output``. ``reasoning`` and ``mcp_*`` items (a previous output sent back) are
skipped; any other item, or a part that is not text (images, files), is a 400 naming it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from services.common.chat_messages import ChatMessage, MessageCall
from services.common.errors import InvalidRequest, TandemError
from services.common.jsonsafe import JsonObject

RequestT = TypeVar("RequestT", bound=BaseModel)

_TEXT_PARTS = {"input_text", "output_text", "text", "refusal"}
_SKIPPED_ITEMS = {"reasoning", "mcp_call", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response"}
_ROLES = {"user", "system", "developer", "assistant"}


def _text_of(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{param} must be text or a list of content parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise InvalidRequest(
                f"{param}[{j}].type {kind!r} is not supported by this server: give input_text parts",
                param=f"{param}[{j}].type",
            )
        text = part.get("text", part.get("refusal", ""))
        if not isinstance(text, str):
            raise InvalidRequest(f"{param}[{j}].text must be a string", param=f"{param}[{j}].text")
        texts.append(text)
    return "".join(texts)


def _field(item: JsonObject, name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{param}.{name} must be a non-empty string", param=f"{param}.{name}")
    return value


def input_messages(items: str | list[JsonObject], earlier: Sequence[ChatMessage] = ()) -> list[ChatMessage]:
    """The request's ``input`` as chat messages; a tool result names its call's function (a call
    of the input, or of the ``earlier`` messages: a stored conversation)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise InvalidRequest("input must not be empty", param="input")
    messages: list[ChatMessage] = []
    names = {
        str(call["id"]): str(call["function"]["name"]) for m in earlier for call in m.get("tool_calls") or []
    }
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{param} must be an object", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise InvalidRequest(
                    f"{param}.role must be user, system, developer or assistant, got {role!r}",
                    param=f"{param}.role",
                )
            messages.append({"role": role, "content": _text_of(item.get("content", ""), f"{param}.content")})
        elif kind == "function_call":
            call_id, name = _field(item, "call_id", param), _field(item, "name", param)
            arguments = item.get("arguments", "")
            if not isinstance(arguments, str):
                raise InvalidRequest(f"{param}.arguments must be JSON text", param=f"{param}.arguments")
            names[call_id] = name
            call: MessageCall = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            last = messages[-1] if messages else None
            # calls right after an assistant message (or after each other) are that message's
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if not last["content"]:
                    last["content"] = None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _field(item, "call_id", param)
            output = item.get("output", "")
            text = output if isinstance(output, str) else _text_of(output, f"{param}.output")
            message: ChatMessage = {"role": "tool", "tool_call_id": call_id, "content": text}
            if call_id in names:
                message["name"] = names[call_id]
            messages.append(message)
        elif kind in _SKIPPED_ITEMS:
            continue
        else:
            raise InvalidRequest(
                f"{param}.type {kind!r} is not supported: give message, function_call or function_call_output items",
                param=f"{param}.type",
            )
    return messages


@dataclass
class ChatTools:
    """The function tools in chat's shape, ``positions[k]`` the index in the request of chat
    tool ``k``; ``others`` the tools of the types the caller takes itself (by their index)."""

    tools: list[JsonObject] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    others: list[tuple[int, JsonObject]] = field(default_factory=list)


def chat_tools(tools: list[JsonObject] | None, also: Sequence[str] = ()) -> ChatTools:
    """Flat Responses function tools as chat tools; a type in ``also`` is set aside for the
    caller, any other type is a 400 naming it."""
    out = ChatTools()
    for i, tool in enumerate(tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in also:
            out.others.append((i, tool))
            continue
        if kind != "function":
            allowed = " or ".join(repr(t) for t in ("function", *also))
            raise InvalidRequest(
                f"tools[{i}].type {kind!r} is not supported by this server: use {allowed}",
                param=f"tools[{i}].type",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.tools.append({"type": "function", "function": function})
        out.positions.append(i)
    return out


def chat_tool_choice(choice: str | JsonObject | None) -> str | JsonObject | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise InvalidRequest(
        f"tool_choice must be none, auto, required or {{'type': 'function', 'name': ...}}, got {choice!r}",
        param="tool_choice",
    )


def chat_response_format(text: JsonObject | None) -> JsonObject | None:
    """``text.format`` as chat's ``response_format`` (none for plain text)."""
    if text is None:
        return None
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequest("text.format must be an object with a type", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise InvalidRequest(
        f"text.format.type must be text, json_object or json_schema, got {kind!r}", param="text.format.type"
    )


_RENAMES = (
    (re.compile(r"^response_format\.json_schema(?=\.|$)"), "text.format"),
    (re.compile(r"^response_format(?=\.|$)"), "text.format"),
    (re.compile(r"^(max_tokens|max_completion_tokens)$"), "max_output_tokens"),
    (re.compile(r"^messages(?=\[|\.|$).*"), "input"),
)
_TOOL_PARAM = re.compile(r"^tools\[(\d+)\](?:\.function)?")


def responses_param(param: str | None, positions: Sequence[int] = ()) -> str | None:
    """The Responses field a chat-path parameter came from (``response_format.json_schema.schema``
    -> ``text.format.schema``, chat tool ``tools[0].function.name`` -> ``tools[2].name``)."""
    if param is None:
        return None
    match = _TOOL_PARAM.match(param)
    if match:
        k = int(match.group(1))
        index = positions[k] if k < len(positions) else k
        return f"tools[{index}]" + param[match.end() :]
    for pattern, new in _RENAMES:
        if pattern.match(param):
            return pattern.sub(new, param, count=1)
    return param


def rename_error(exc: TandemError, positions: Sequence[int] = ()) -> TandemError:
    """``exc`` with its parameter (and the message's mention of it) in Responses' terms."""
    new = responses_param(exc.param, positions)
    if new != exc.param and exc.param is not None and new is not None:
        # a field path is rewritten where the message spells it; a plain word ("messages") is kept
        technical = any(c in exc.param for c in ".[_")
        exc.message = exc.message.replace(exc.param, new) if technical else f"{new}: {exc.message}"
        exc.args = (exc.message,)
        exc.param = new
    return exc


def chat_request(cls: type[RequestT], fields: dict[str, Any]) -> RequestT:
    """The service's chat request of ``fields``; a value it refuses is a 400 naming the field."""
    try:
        return cls.model_validate(fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = ".".join(str(p) for p in err["loc"])
        raise InvalidRequest(f"{name}: {err['msg']}", param=name) from None
