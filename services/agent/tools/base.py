"""The ``Tool`` protocol and the guarded way every tool call runs (time limit, errors as observations)."""

from __future__ import annotations

import asyncio
import inspect
import json
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from services.agent.clients import RetrievalClient
from services.common.telemetry import set_attributes, span


@dataclass
class ToolContext:
    """What a tool may use for one agent run."""

    retrieval: RetrievalClient | None = None
    collection: str | None = None


@runtime_checkable
class Tool(Protocol):
    """A tool: ``run`` takes the model's argument (a string, or a dict from OpenAI tool calls) and
    returns the observation text. ``run`` may be sync or async; ``parameters`` is a JSON schema.
    A tool whose calls act on the world also sets ``side_effects = True`` (``has_side_effects``),
    and one that can run only under some conditions says which in ``needs`` (``tool_needs``)."""

    name: str
    description: str
    parameters: dict[str, Any]

    def run(self, argument: Any, ctx: ToolContext) -> Any: ...


def has_side_effects(tool: Tool) -> bool:
    """Whether a call of ``tool`` may act on the world (send a request, change data): its
    ``side_effects`` attribute (``http_get``; an MCP tool its server does not mark read-only).
    A tool that does not say is taken to have none, as the built-in calculator and search."""
    return bool(getattr(tool, "side_effects", False))


def tool_needs(tool: Tool) -> frozenset[str]:
    """What ``tool`` needs to run for a request (its ``needs`` attribute): ``collection``, a
    collection the caller may read; ``outbound``, outbound calls switched on. An agent offers a
    tool only when the request has what it needs (agents/offering.py); a tool that does not say
    needs nothing."""
    return frozenset(getattr(tool, "needs", ()))


def call_fingerprint(tool: str, argument: Any) -> str:
    """One tool call, the same however its arguments were ordered: what an approval allows."""
    return json.dumps([tool, argument], sort_keys=True, default=str)


def single_string_schema(
    field: str, description: str, max_length: int = 200, pattern: str | None = None
) -> dict[str, Any]:
    """One required string argument and nothing else. Bounded, and closed to other keys, because
    forced calls are constrained to this schema: a small model then cannot copy the schema's own
    keys into its arguments or run on inside the string until ``max_tokens`` cuts the call."""
    prop: dict[str, Any] = {"type": "string", "description": description}
    # a pattern carries its own bounds (xgrammar ignores min/maxLength next to one, with a warning)
    prop.update({"pattern": pattern} if pattern is not None else {"minLength": 1, "maxLength": max_length})
    return {
        "type": "object",
        "properties": {field: prop},
        "required": [field],
        "additionalProperties": False,
    }


def constrained_input(parameters: dict[str, Any]) -> dict[str, Any] | None:
    """The schema of a one-string-argument tool's input when it constrains more than length (a
    pattern or an enum), so a text protocol's single input can follow it; otherwise None."""
    props = parameters.get("properties") or {}
    if len(props) != 1:
        return None
    (prop,) = props.values()
    if not isinstance(prop, dict) or prop.get("type") != "string" or not ({"pattern", "enum"} & set(prop)):
        return None
    return {k: v for k, v in prop.items() if k != "description"}


def argument_text(argument: Any, field: str) -> str:
    """A tool's one string argument, however the model sent it."""
    if isinstance(argument, dict):
        if field in argument:
            return str(argument[field])
        if len(argument) == 1:
            return str(next(iter(argument.values())))
        return json.dumps(argument)
    return str(argument)


async def call_tool(tool: Tool, argument: Any, ctx: ToolContext, timeout: float) -> tuple[str, bool]:
    """Runs a tool; returns (observation, ok). A tool that raises or hangs gives an error observation
    (the agent reads it and carries on) instead of taking the run down. A sync tool runs in a thread:
    one that hangs keeps its thread, but the run stops waiting for it."""
    with span("tool.call", tool=tool.name, kind=type(tool).__name__) as current:
        try:
            if inspect.iscoroutinefunction(tool.run):
                result = await asyncio.wait_for(tool.run(argument, ctx), timeout)
            else:
                result = await asyncio.wait_for(asyncio.to_thread(tool.run, argument, ctx), timeout)
        except TimeoutError:
            set_attributes(current, ok=False, error="timeout")
            return f"error: tool {tool.name!r} did not answer within {timeout:g} s", False
        except Exception as exc:
            set_attributes(current, ok=False, error=type(exc).__name__)
            return f"error: tool {tool.name!r} failed: {type(exc).__name__}: {exc}", False
        set_attributes(current, ok=True)
    return (result if isinstance(result, str) else json.dumps(result, default=str)), True
