"""No import circle among the modules of ``services/``: every import in the tree counts (module
level, inside functions, and under ``if TYPE_CHECKING``), because a circle that only type
checking closes is still two modules that cannot be read, tested or replaced one without the
other. A package's ``__init__`` is not an edge of the modules under it (Python runs it first,
whatever imports them). A new circle fails here, naming its modules in import order."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO_ROOT

ROOT = "services"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    """``name`` if it is a module of the tree, else the longest prefix of it that is one
    (``from pkg.mod import function`` depends on ``pkg.mod``); None outside the tree."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imported(path: Path, modules: set[str]) -> set[str]:
    """The modules of the tree that ``path`` imports."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod
            names = [f"{base}.{a.name}" for a in node.names] or [base]
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != here:
                out.add(target)
    return out


def import_graph(root: str = ROOT) -> dict[str, set[str]]:
    paths = sorted((REPO_ROOT / root).rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported(p, modules) for p in paths}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(start: str) -> None:
        # iterative, so a deep chain of imports does not reach Python's recursion limit
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(out)


def one_circle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest circle through the component's first module, as a path of imports."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    return component  # unreachable for a strongly connected component


def test_the_graph_sees_imports_of_every_kind() -> None:
    graph = import_graph()
    assert "services.common.errors" in graph["services.agent.runtime"]  # module level
    assert "services.agent.pipelines.components" in graph["services.agent.pipelines.definition"]  # relative
    assert "services.agent.pipelines.state" in graph["services.agent.promotions"]  # type checking only
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert one_circle({"a": {"b", "c"}, "b": {"a"}, "c": {"b"}}, ["a", "b", "c"]) == ["a", "b", "a"]


# Circles still to untie, each as the modules it holds. One may shrink or go; a new circle, or
# one that takes in another module, fails.
KNOWN: list[frozenset[str]] = [
    frozenset({"services.common.platforms", "services.common.platforms.cpu"}),
    frozenset({"services.inference.config", "services.inference.embeddings"}),
    frozenset(
        {
            "services.inference.engine.fused_decode",
            "services.inference.engine.fused_prompt",
            "services.inference.engine.plan",
            "services.inference.engine.runner",
        }
    ),
    frozenset({"services.retrieval.core.backend", "services.retrieval.milvus.backend"}),
    frozenset(
        {
            "services.retrieval.core.format_errors",
            "services.retrieval.core.formats",
            "services.retrieval.core.formats_mail",
            "services.retrieval.core.image_files",
            "services.retrieval.core.parsing",
            "services.retrieval.core.tables",
        }
    ),
    frozenset({"services.retrieval.ingest", "services.retrieval.sources.sync"}),
]


def named(graph: dict[str, set[str]], component: list[str]) -> str:
    return " -> ".join(one_circle(graph, component)) + f" ({len(component)} modules)"


def test_the_agent_has_no_import_circle() -> None:
    graph = import_graph("services/agent")
    assert [named(graph, c) for c in circles(graph)] == []


def test_services_have_no_new_import_circle() -> None:
    graph = import_graph()
    new = [named(graph, c) for c in circles(graph) if not any(set(c) <= known for known in KNOWN)]
    assert new == [], "import circles:\n" + "\n".join(new)
