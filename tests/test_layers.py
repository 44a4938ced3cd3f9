"""The layers docs/architecture.md states, checked on every import in the tree (module-level and
inside functions alike): ``kernels/`` imports no service; ``services/common`` imports no service;
a service imports only ``services.common`` and itself, except the trainer's in-process use of the
inference engine library; ``services/inference/engine`` imports nothing else of the inference
service, nor FastAPI. A new cross-import fails here, naming the file and the module."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

from tests.conftest import REPO_ROOT

SERVICES = ("agent", "inference", "retrieval", "trainer", "cli")
# (importing package, imported module prefix): the exceptions, each with its reason
ALLOWED = {
    # the trainer's rollouts run the engine in process, and its job checks resolve models the
    # way the engine loads them (the engine is a library on purpose: see docs/architecture.md)
    ("trainer", "services.inference.engine"),
    # `tandem eval rag` scores answers with the agent's own citation and grounding checks
    ("cli", "services.agent.citations"),
    ("cli", "services.agent.grounding"),
    # ... and with the evaluation API's judge, so the CLI and the API score answers alike
    ("cli", "services.agent.evals"),
}


def imports(path: Path) -> list[str]:
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from services import retrieval` imports services.retrieval: name each one
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def offending(root: str, rule: Callable[[Path, str], str]) -> list[str]:
    bad = []
    for path in sorted((REPO_ROOT / root).rglob("*.py")):
        for module in imports(path):
            why = rule(path.relative_to(REPO_ROOT), module)
            if why:
                bad.append(f"{path.relative_to(REPO_ROOT)}: {module} ({why})")
    return bad


def test_kernels_import_no_service() -> None:
    def rule(path: Path, module: str) -> str:
        return "kernels are the bottom layer" if module.split(".")[0] == "services" else ""

    assert offending("kernels", rule) == []


def test_common_imports_no_service() -> None:
    def rule(path: Path, module: str) -> str:
        parts = module.split(".")
        return "common imports no service" if parts[0] == "services" and parts[1:2] != ["common"] else ""

    assert offending("services/common", rule) == []


def test_services_meet_over_http_not_imports() -> None:
    def rule(path: Path, module: str) -> str:
        own = path.parts[1]
        parts = module.split(".")
        if parts[0] != "services" or len(parts) < 2 or parts[1] in ("common", own):
            return ""
        if any(own == o and (module == m or module.startswith(m + ".")) for o, m in ALLOWED):
            return ""
        return f"services/{own} imports services/{parts[1]}"

    assert [b for s in SERVICES for b in offending(f"services/{s}", rule)] == []


def test_the_engine_library_imports_nothing_else_of_inference() -> None:
    def rule(path: Path, module: str) -> str:
        if module.split(".")[0] == "fastapi" or module.split(".")[0] == "starlette":
            return "the engine is a library: no web framework"
        inside = module.startswith("services.inference.")
        return "outside the engine" if inside and not module.startswith("services.inference.engine") else ""

    assert offending("services/inference/engine", rule) == []
