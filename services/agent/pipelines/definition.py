"""Pipeline definitions (YAML or JSON), validated before anything runs.

A definition names its components and the order constraints between them::

    name: chat-documents
    kind: chat                 # chat: answers with tokens and citations; search: returns results
    components:
      rewrite:  {type: history_rewriter}
      retrieve: {type: retriever, after: [rewrite], params: {mode: hybrid}}
      ...

Validation errors name the file, the pipeline, the component and the value: an
unknown component type (listing the known ones), a dependency on a component
that does not exist, a cycle (printed as ``a -> b -> a``), a bad parameter, a
component that needs a slot of the run state (``state.Sockets``) that none of
the components it runs after writes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common.errors import InvalidRequest
from services.common.jsonsafe import JsonObject
from services.common.telemetry import set_attributes, tracer, within

from .components import NODE_TYPES, Component
from .state import Event, RunContext, RunState, Sockets, UndeclaredWrite

NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
BUILTIN_DIR = Path(__file__).parent / "builtin"


class PipelineDefinitionError(InvalidRequest):
    """A pipeline definition that cannot be built."""


class NodeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: str
    after: list[str] = Field(default_factory=list)
    params: JsonObject = Field(default_factory=dict)  # checked by the component's own ``P``


class PipelineSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    description: str = ""
    kind: Literal["chat", "search"]
    components: dict[str, NodeSpec] = Field(min_length=1)


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "definition"
        got = f" (got {err['input']!r})" if err.get("type") not in ("missing",) and "input" in err else ""
        parts.append(f"{loc}: {err['msg']}{got}")
    return "; ".join(parts)


def find_cycle(edges: dict[str, list[str]]) -> list[str] | None:
    """A cycle in the graph ``node -> nodes it runs after``, as a closed path, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in edges.get(node, []):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if state.get(dep) is None:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in edges:
        if state.get(node) is None:
            found = visit(node)
            if found:
                return found
    return None


def topological_order(edges: dict[str, list[str]]) -> list[str]:
    """Nodes in an order that respects ``after`` (stable: definition order breaks ties)."""
    order: list[str] = []
    done: set[str] = set()
    remaining = list(edges)
    while remaining:
        for node in remaining:
            if all(dep in done for dep in edges[node]):
                order.append(node)
                done.add(node)
                remaining.remove(node)
                break
        else:  # pragma: no cover - find_cycle runs first
            raise PipelineDefinitionError(f"cycle among {remaining}")
    return order


@dataclass
class Pipeline:
    spec: PipelineSpec
    order: list[str]
    nodes: dict[str, Component]
    source: str

    @property
    def name(self) -> str:
        return self.spec.name

    async def run(self, state: RunState, ctx: RunContext) -> AsyncIterator[Event]:
        for name in self.order:
            kind = self.spec.components[name].type
            current = tracer("tandem.agent").start_span(f"pipeline.{kind}", attributes={"node": name})
            node = self.nodes[name]
            before = state.held()
            try:
                async for event in within(current, node.run(state, ctx)):
                    yield event
                undeclared = state.changed(before) - node.sockets.writes
                if undeclared:
                    raise UndeclaredWrite(
                        f"pipeline {self.name!r}: component {name!r} ({kind}) wrote "
                        f"{', '.join(sorted(undeclared))}, which its sockets do not declare"
                    )
                set_attributes(current, **node_attributes(kind, state))
            finally:
                current.end()


# A span attribute's value (None: left out, see telemetry.set_attributes).
SpanValue = str | int | float | None


def node_attributes(kind: str, state: RunState) -> dict[str, SpanValue]:
    """What a node's span says once it ran: hits, prompt tokens, the model and its usage, the
    groundedness guard's verdict."""
    if kind in ("retriever", "overlap_reranker", "reader_ranker", "relevance_filter"):
        return {"hits": len(state.chunks)}
    if kind == "prompt_builder" and state.plan is not None:
        plan = state.plan
        return {"tokens": plan.prompt_tokens, "sources": len(plan.sources), "budget": plan.budget}
    if kind == "generator":
        return {
            "model": state.model or None,
            "prompt_tokens": state.usage.get("prompt_tokens"),
            "completion_tokens": state.usage.get("completion_tokens"),
            "finish_reason": state.finish_reason,
        }
    if kind == "groundedness_guard":
        return {"verdict": state.grounding, "groundedness": state.groundedness, "kind": state.answer_kind}
    return {}


def build_pipeline(data: Any, source: str = "<definition>") -> Pipeline:
    where = f"pipeline definition {source}"
    if not isinstance(data, dict):
        raise PipelineDefinitionError(f"{where}: expected a mapping, got {type(data).__name__}")
    try:
        spec = PipelineSpec.model_validate(data)
    except ValidationError as exc:
        raise PipelineDefinitionError(f"{where}: {_describe(exc)}") from None
    where = f"pipeline {spec.name!r} ({source})"
    edges: dict[str, list[str]] = {}
    for name, node in spec.components.items():
        if node.type not in NODE_TYPES:
            raise PipelineDefinitionError(
                f"{where}: component {name!r} has unknown type {node.type!r} "
                f"(known: {', '.join(sorted(NODE_TYPES))})",
                param=f"components.{name}.type",
            )
        for dep in node.after:
            if dep not in spec.components:
                raise PipelineDefinitionError(
                    f"{where}: component {name!r} runs after {dep!r}, which is not a component of this pipeline",
                    param=f"components.{name}.after",
                )
        edges[name] = list(node.after)
    cycle = find_cycle(edges)
    if cycle:
        raise PipelineDefinitionError(
            f"{where}: components form a cycle: {' -> '.join(cycle)}", param="components"
        )
    nodes: dict[str, Component] = {}
    for name, node in spec.components.items():
        params_model, factory = NODE_TYPES[node.type]
        try:
            params = params_model.model_validate(node.params)
        except ValidationError as exc:
            raise PipelineDefinitionError(
                f"{where}: component {name!r} ({node.type}): {_describe(exc)}",
                param=f"components.{name}.params",
            ) from None
        try:
            nodes[name] = factory(params)
        except InvalidRequest as exc:
            raise PipelineDefinitionError(
                f"{where}: component {name!r} ({node.type}): {exc.message}", param=f"components.{name}.params"
            ) from None
    check_needs(spec, edges, nodes, where)
    return Pipeline(spec=spec, order=topological_order(edges), nodes=nodes, source=source)


def ancestors(edges: dict[str, list[str]], name: str) -> set[str]:
    """The components ``name`` runs after, directly or through others."""
    seen: set[str] = set()
    stack = list(edges[name])
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(edges[node])
    return seen


def check_needs(
    spec: PipelineSpec, edges: dict[str, list[str]], nodes: dict[str, Component], where: str
) -> None:
    """Every slot a component needs is written by a component it runs after: order among
    components without an ``after`` between them is not defined, so an earlier one by chance
    does not count."""
    for name, node in nodes.items():
        before = ancestors(edges, name)
        written = {slot for other in before for slot in nodes[other].sockets.writes}
        missing = sorted(node.sockets.needs - written)
        if not missing:
            continue
        slot = missing[0]
        writers = sorted(
            {
                f"{spec.components[n].type}"
                for n, other in nodes.items()
                if slot in other.sockets.writes and n != name
            }
        )
        if not writers:  # none in this pipeline: the node types that would
            writers = sorted(
                t for t, (_, make) in NODE_TYPES.items() if slot in getattr(make, "sockets", Sockets()).writes
            )
        known = f"; written by: {', '.join(writers)}" if writers else ""
        raise PipelineDefinitionError(
            f"{where}: component {name!r} ({spec.components[name].type}) needs {slot!r}, which none of the "
            f"components it runs after writes (add the one that writes it to its 'after'{known})",
            param=f"components.{name}.after",
        )


def parse_definition_text(text: str, source: str) -> Any:
    try:
        if source.endswith(".json"):
            return json.loads(text)
        return yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise PipelineDefinitionError(f"pipeline definition {source}: not valid YAML/JSON: {exc}") from None


def load_definition_file(path: Path) -> Pipeline:
    return build_pipeline(parse_definition_text(path.read_text(encoding="utf-8"), path.name), path.name)


def load_pipelines(extra_dir: str | Path | None = None) -> dict[str, Pipeline]:
    """The built-in pipelines plus those of ``extra_dir`` (which may replace a built-in by name)."""
    out: dict[str, Pipeline] = {}
    dirs = [BUILTIN_DIR] + ([Path(extra_dir)] if extra_dir else [])
    for folder in dirs:
        if not folder.is_dir():
            raise PipelineDefinitionError(f"pipelines folder {str(folder)!r} does not exist")
        for path in sorted(folder.iterdir()):
            if path.suffix in (".yaml", ".yml", ".json"):
                pipeline = load_definition_file(path)
                out[pipeline.name] = pipeline
    return out
