"""The spans a forced final answer may copy from a tool result."""

from services.agent.agents.answer_spans import answer_spans


def test_spans_are_runs_of_words_within_a_line_without_source_tags_or_edge_punctuation() -> None:
    spans = answer_spans("[eiffel] The tower is 330 metres tall.\n[nile] The Nile is long.")
    assert spans[:4] == ["The", "tower", "is", "330"]  # shortest first, in reading order
    assert {"330", "330 metres", "330 metres tall", "Nile", "The Nile is long"} <= set(spans)
    assert not any("[" in s or s.endswith(".") for s in spans)
    assert "tall. The" not in " | ".join(spans) and "tall The" not in spans  # never across lines
    assert len(spans) == len(set(spans))


def test_a_number_result_gives_itself_and_the_bounds_hold() -> None:
    assert answer_spans("391") == ["391"]
    assert answer_spans("   \n ") == []
    long = " ".join(f"w{i}" for i in range(200))
    spans = answer_spans(long, max_words=3, limit=50)
    assert len(spans) == 50 and all(len(s.split()) <= 3 for s in spans)
