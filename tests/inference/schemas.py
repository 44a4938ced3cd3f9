"""JSON schemas and tools shared by the structured-output tests of the engine and the API."""

from __future__ import annotations

from typing import Any

# bounded so a random model, which never chooses to close a free string, still finishes
THING_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "s": {"type": "string", "maxLength": 5},
    },
    "required": ["ok", "n", "tags", "s"],
    "additionalProperties": False,
}
ADD_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}


def function_tool(name: str, parameters: dict[str, Any], description: str | None = None) -> dict[str, Any]:
    """An OpenAI ``tools`` entry."""
    described = {"description": description} if description is not None else {}
    return {"type": "function", "function": {"name": name, **described, "parameters": parameters}}
