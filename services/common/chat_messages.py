"""Chat messages as the JSON of a chat completions request's ``messages``: what the Responses API
builds from a request's input items, stores with a response, and sends on to the chat path.

These are the JSON forms of ``openai_wire.ToolCall`` and of a message that holds one; the wire
models validate a request, these type the dicts built here and read back from storage.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict


class CalledFunction(TypedDict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class MessageCall(TypedDict):
    """``openai_wire.ToolCall`` as JSON."""

    id: str
    type: str  # "function"
    function: CalledFunction


class ChatMessage(TypedDict):
    role: str  # system, developer, user, assistant or tool
    content: str | None  # None: an assistant message that only calls tools
    tool_calls: NotRequired[list[MessageCall]]  # assistant
    tool_call_id: NotRequired[str]  # tool: the call this is the result of
    name: NotRequired[str]  # tool: the function called
