"""The parsing sandbox: a real child process per untrusted file, killed at its time limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.retrieval.core.parsing import ParseLimitError, ParseLimits
from services.retrieval.core.sandbox import parse_isolated


def test_parsing_past_the_time_limit_is_a_per_file_error(tmp_path: Path) -> None:
    page = tmp_path / "slow.html"
    page.write_text("<html><body>" + "<div><p>nested text</p></div>" * 200_000 + "</body></html>")
    with pytest.raises(ParseLimitError) as err:
        parse_isolated(page, "slow.html", ParseLimits(timeout_s=0.2))
    assert "slow.html" in err.value.message and "longer than 0.2 s" in err.value.message
    assert "TANDEM_RETRIEVAL_PARSE_TIMEOUT_S" in err.value.message


def test_a_normal_file_parses_in_the_child(tmp_path: Path) -> None:
    page = tmp_path / "ok.html"
    page.write_text(
        "<html><head><title>T</title></head><body><h1>Owls</h1><p>Silent flight.</p></body></html>"
    )
    [doc] = parse_isolated(page, "ok.html", ParseLimits())
    assert doc.title == "T" and "# Owls" in doc.text and doc.metadata == {"source": "ok.html"}
