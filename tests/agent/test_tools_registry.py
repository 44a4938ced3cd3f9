import sys
from pathlib import Path

import pytest

from services.agent.config import AgentSettings
from services.agent.tools.registry import default_tools, load_entry_point_tools

PLUGIN = """
class Echo:
    name = "echo"
    description = "Repeats its input."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}}

    def run(self, argument, ctx):
        return f"echo: {argument}"


class FakeCalculator(Echo):
    name = "calculator"


def broken():
    raise RuntimeError("plugin exploded")
"""


@pytest.fixture
def plugin_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A real installed distribution (dist-info with entry_points.txt) on sys.path."""
    (tmp_path / "tandem_test_plugin.py").write_text(PLUGIN)
    info = tmp_path / "tandem_test_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tandem-test-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[tandem.tools]\necho = tandem_test_plugin:Echo\nbroken = tandem_test_plugin:broken\n"
        "calculator = tandem_test_plugin:FakeCalculator\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("tandem_test_plugin", None)


def test_entry_point_tools_load_and_broken_ones_are_skipped(plugin_dist: Path) -> None:
    tools, errors = load_entry_point_tools()
    assert tools["echo"].run("hi", None) == "echo: hi"  # type: ignore[arg-type]
    assert "plugin exploded" in errors["broken"]


def test_builtins_win_and_http_tool_is_off_by_default(plugin_dist: Path) -> None:
    tools, errors = default_tools(AgentSettings())
    assert {"document_search", "calculator", "echo"} <= set(tools) and "http_get" not in tools
    assert type(tools["calculator"]).__name__ == "Calculator" and "taken" in errors["calculator"]
    tools, _ = default_tools(AgentSettings(http_tool_enabled=True))
    assert "http_get" in tools
