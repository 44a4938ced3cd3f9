"""Which tools one agent run is offered: only those that can run for the request, and the tools of
an MCP server the request names first.

A tool says what it needs (``tool_needs``, tools/base.py): ``collection``, a collection the caller
may read (``document_search``), or ``outbound``, outbound calls switched on (``http_get``). An MCP
server that could not be listed for the run (refused by the address rules, unreachable, a stored
header it cannot read) stands in as ``UnavailableServer`` (tools/mcp.py) and is left out with its
error. A tool with side effects is left out when the agent refuses such tools. A tool offered that
cannot run only teaches a small model to call it: SmolLM2-135M, offered ``document_search`` without
a collection, called it on every run instead of the server the request named.

The runner lists the named servers' tools first, points the prompt at them (``preference_note``)
and lets a constrained first step call only them (``AgentRunner._named_first``). What is left out
is said tool by tool with the reason, in the run's ``tools`` step and its trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from services.agent.tools.base import Tool, ToolContext, has_side_effects, tool_needs
from services.agent.tools.mcp import UnavailableServer
from services.common.errors import Forbidden, NotFound, TandemError

# What an agent does with a tool call that has side effects (tools/base.py ``has_side_effects``):
# "refuse": such tools are not offered to the model at all; "approve": the run pauses at the call
# with an ``approval_required`` event, and runs again once a person approved or denied it.
SideEffects = Literal["refuse", "approve"]

NO_COLLECTION = "no collection was given for this conversation"
# Why a tool is left out: what the request lacks for it.
Cause = Literal["unavailable", "collection", "outbound", "side_effects"]


@dataclass(frozen=True)
class Conditions:
    """What the request allows: the tools' needs are checked against it."""

    # a collection the caller may read, or None (and ``no_collection`` says why)
    collection: str | None = None
    no_collection: str = NO_COLLECTION
    outbound: bool = True
    side_effects: SideEffects = "refuse"
    named: tuple[str, ...] = ()  # MCP servers the request names, in its order


@dataclass(frozen=True)
class LeftOut:
    tool: str
    cause: Cause
    reason: str  # the cause in words, for people
    server: str | None = None  # the MCP server the tool is of


@dataclass
class Offer:
    tools: dict[str, Tool]  # in the order the model sees them: the named servers' tools first
    preferred: list[str] = field(default_factory=list)  # the named servers' tools
    left_out: list[LeftOut] = field(default_factory=list)

    @property
    def notable(self) -> bool:
        """Whether the offer is worth a ``tools`` step: something left out, or a server preferred."""
        return bool(self.left_out or self.preferred)


def server_of(tool: Tool) -> str | None:
    """The MCP server a tool is of (``McpTool``, ``UnavailableServer``), None for other tools."""
    server = getattr(tool, "server", None)
    return server if isinstance(server, str) else None


def why_not(tool: Tool, conditions: Conditions) -> tuple[Cause, str] | None:
    """Why ``tool`` cannot run for the request (the cause, and in words), or None when it can."""
    if isinstance(tool, UnavailableServer):
        return "unavailable", tool.error
    needs = tool_needs(tool)
    if "collection" in needs and conditions.collection is None:
        return "collection", conditions.no_collection
    if "outbound" in needs and not conditions.outbound:
        return "outbound", "outbound calls are off (TANDEM_AGENT_HTTP_TOOL_ENABLED)"
    if conditions.side_effects == "refuse" and has_side_effects(tool):
        return (
            "side_effects",
            "it has side effects and this agent refuses such tools (TANDEM_AGENT_TOOL_SIDE_EFFECTS)",
        )
    return None


def offer(tools: dict[str, Tool], conditions: Conditions) -> Offer:
    """The tools that can run, the named servers' first (in the order the request names them),
    the others in their given order; and those left out, each with why."""
    runnable: dict[str, Tool] = {}
    left_out: list[LeftOut] = []
    for name, tool in tools.items():
        why = why_not(tool, conditions)
        if why is None:
            runnable[name] = tool
        else:
            left_out.append(LeftOut(name, *why, server=server_of(tool)))
    rank = {server: i for i, server in enumerate(conditions.named)}
    preferred = sorted(
        (n for n, t in runnable.items() if server_of(t) in rank),
        key=lambda n: rank[server_of(runnable[n]) or ""],
    )
    ordered = {n: runnable[n] for n in preferred} | runnable
    return Offer(ordered, preferred, left_out)


async def readable_collection(ctx: ToolContext) -> tuple[str | None, str]:
    """The run's collection when the caller may read it (retrieval asked with the caller's own
    key), else None and why."""
    collection = ctx.collection
    if not collection:
        return None, NO_COLLECTION
    if ctx.retrieval is None:
        return None, f"collection {collection!r}: no retrieval service for this run"
    try:
        await ctx.retrieval.check_readable(collection)
    except (NotFound, Forbidden):
        return None, f"collection {collection!r} does not exist or this caller may not read it"
    except TandemError as exc:
        return None, f"collection {collection!r} could not be checked: {exc.message}"
    return collection, ""


def preference_note(offered: Offer, conditions: Conditions) -> str:
    """The sentence that points the model at the named servers' tools (empty when none)."""
    if not offered.preferred:
        return ""
    servers = [
        s for s in conditions.named if any(server_of(offered.tools[n]) == s for n in offered.preferred)
    ]
    return (
        f"This question is for the MCP server {', '.join(repr(s) for s in servers)}: "
        f"call {' or '.join(offered.preferred)}."
    )


def summary(offered: Offer) -> str:
    """One line for people: what is offered, and what is left out and why."""
    line = f"offered: {', '.join(offered.tools) or 'no tools'}"
    if offered.left_out:
        line += "; left out: " + "; ".join(f"{lo.tool} ({lo.reason})" for lo in offered.left_out)
    return line
