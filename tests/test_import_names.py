"""Tandem's own top-level import names never equal another distribution's.

A top-level package of ours named like another distribution's module shadows it from the
project root (`kernels` once hid Hugging Face's hub-kernels, which transformers >= 5.25 imports
at start-up). Every installed distribution's top-level names are checked, and a few well-known
ones a user may add beside Tandem that this environment may not hold.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Top-level modules of distributions a user may install beside Tandem (Hugging Face's hub
# kernels, vLLM, llama.cpp's binding, the MCP SDK, OpenTelemetry, LangChain, Milvus).
WELL_KNOWN = {"kernels", "vllm", "llama_cpp", "mcp", "opentelemetry", "langchain", "milvus_lite", "tests"}


def own_top_level_names() -> set[str]:
    """The top-level packages the project's setuptools configuration installs."""
    conf = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    names: set[str] = set()
    for where in conf["where"]:
        for init in sorted((REPO_ROOT / where).glob("*/__init__.py")):
            name = init.parent.name
            if any(name == pat.rstrip("*") for pat in conf["include"]):
                names.add(name)
    return names


def test_own_names_are_the_installed_ones() -> None:
    assert own_top_level_names() == {"services", "tandem_kernels"}
    provided = importlib.metadata.packages_distributions()
    for name in own_top_level_names():
        assert set(provided.get(name, [])) == {"tandem"}, f"{name} is installed by {provided.get(name)}"


def test_no_own_name_belongs_to_another_distribution() -> None:
    provided = importlib.metadata.packages_distributions()
    clashes = {
        name: sorted(set(provided[name]) - {"tandem"})
        for name in own_top_level_names()
        if set(provided.get(name, [])) - {"tandem"}
    }
    assert clashes == {}, f"Tandem's top-level names are also another distribution's: {clashes}"
    assert own_top_level_names() & WELL_KNOWN == set()


def test_no_top_level_package_named_kernels_at_the_root() -> None:
    """From the project root, `import kernels` must reach Hugging Face's distribution, never the
    folder of Tandem's kernels (which holds no package of that name)."""
    assert not (REPO_ROOT / "kernels" / "__init__.py").exists()
    import kernels as hf  # in the lock: transformers >= 5.25 requires it

    assert Path(hf.__file__ or "").resolve().parent != REPO_ROOT / "kernels"
    assert importlib.metadata.version("kernels")
