"""Which tools an agent gets: the built-ins plus user tools from the ``tandem.tools`` entry points.

A package registers a tool in its metadata::

    [project.entry-points."tandem.tools"]
    weather = "my_pkg.tools:WeatherTool"

The entry point may name a Tool instance, a class, or a factory called without
arguments. One that fails to load, or is not a Tool, is logged and skipped:
a broken plugin never takes the service down.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Any

from services.agent.config import AgentSettings
from services.agent.tools.base import Tool
from services.agent.tools.calculator import Calculator
from services.agent.tools.http_get import HttpGet
from services.agent.tools.search import DocumentSearch

log = logging.getLogger("tandem.agent.tools")
ENTRY_POINT_GROUP = "tandem.tools"


def _is_tool(obj: Any) -> bool:
    return (
        isinstance(getattr(obj, "name", None), str)
        and isinstance(getattr(obj, "description", None), str)
        and callable(getattr(obj, "run", None))
    )


def load_entry_point_tools(group: str = ENTRY_POINT_GROUP) -> tuple[dict[str, Tool], dict[str, str]]:
    """(tools by name, load errors by entry point name)."""
    tools: dict[str, Tool] = {}
    errors: dict[str, str] = {}
    for ep in entry_points(group=group):
        try:
            obj = ep.load()
            if isinstance(obj, type) or (not _is_tool(obj) and callable(obj)):
                obj = obj()
            if not _is_tool(obj):
                raise TypeError("not a Tool (needs name, description and run)")
            if not hasattr(obj, "parameters"):
                obj.parameters = {"type": "object", "properties": {"input": {"type": "string"}}}
            tools[obj.name] = obj
        except Exception as exc:
            errors[ep.name] = f"{type(exc).__name__}: {exc}"
            log.warning("tool entry point %r skipped: %s", ep.name, errors[ep.name])
    return tools, errors


def default_tools(settings: AgentSettings) -> tuple[dict[str, Tool], dict[str, str]]:
    tools: dict[str, Tool] = {
        "document_search": DocumentSearch(top_k=settings.search_tool_top_k),
        "calculator": Calculator(),
    }
    if settings.http_tool_enabled:
        tools["http_get"] = HttpGet(max_bytes=settings.http_tool_max_bytes, timeout=settings.tool_timeout_s)
    extra, errors = load_entry_point_tools()
    for name, tool in extra.items():
        if name in tools:
            errors[name] = f"tool name {name!r} is taken by a built-in tool"
            continue
        tools[name] = tool
    return tools, errors
