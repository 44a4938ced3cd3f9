"""Where sentences end: what the answer step, the guard and citations split source text by."""

from __future__ import annotations

from services.common.text import sentences


def split(text: str) -> list[str]:
    return [text[s:e] for s, e in sentences(text)]


def test_abbreviations_and_decimals_do_not_end_a_sentence() -> None:
    text = "It is said with a short 'i' -- ie. like \"grinned\". Use a flag, e.g. -g, here. Pi is 3.14 ok."
    assert split(text) == [
        "It is said with a short 'i' -- ie. like \"grinned\".",
        "Use a flag, e.g. -g, here.",
        "Pi is 3.14 ok.",
    ]


def test_a_numbered_item_keeps_its_marker_and_a_line_break_ends_a_line() -> None:
    text = "`tandem up` runs:\n\n1. checks the settings;\n2. starts Valkey.\nSee below"
    assert split(text) == ["`tandem up` runs:", "1. checks the settings;", "2. starts Valkey.", "See below"]
