from services.agent.chunks import Chunk
from services.agent.citations import CitationTracker, attribute, marker_numbers
from services.agent.highlight import highlight


def chunks() -> list[Chunk]:
    return [
        Chunk("a#0", "a", "Paris is the capital of France.", start=100, end=131, title="France"),
        Chunk("b#0", "b", "Berlin is the capital of Germany.", start=0, end=33, title="Germany"),
    ]


def test_markers_in_all_shapes() -> None:
    assert marker_numbers("x [1] y [2, 3][4] [Source 5] [source: 6] [1]") == [1, 2, 3, 4, 5, 6]
    assert marker_numbers("no markers [a] [] [12345]") == []


def test_streamed_markers_split_across_deltas_resolve_once() -> None:
    tracker = CitationTracker(chunks())
    got = []
    for delta in ["Paris is the capital [", "1", "] and Berlin [2", "]. Again [1]. Bad [7]."]:
        got += tracker.feed(delta)
    got += tracker.finish()
    assert [(c.index, c.document_id, c.chunk_id) for c in got] == [(1, "a", "a#0"), (2, "b", "b#0")]
    assert got[0].start == 100 and got[0].end == 131 and got[0].title == "France"
    assert tracker.invalid == [7]


def test_open_bracket_is_held_until_complete() -> None:
    tracker = CitationTracker(chunks())
    assert tracker.feed("answer [") == []
    assert [c.index for c in tracker.feed("2]")] == [2]


def test_attribution_only_when_answer_overlaps_enough() -> None:
    found = attribute("The capital of Germany is Berlin.", chunks())
    assert [(c.document_id, c.kind) for c in found] == [("b", "attributed")]
    assert attribute("Bananas are yellow.", chunks()) == []


def test_highlight_marks_the_matching_sentence_with_document_offsets() -> None:
    text = "Cats sleep a lot. The Eiffel Tower is in Paris. Dogs bark."
    chunk = Chunk("c#1", "c", text, start=1000, end=1000 + len(text))
    out = highlight("where is the Eiffel Tower", chunk)
    assert out["passage"]["text"] == "The Eiffel Tower is in Paris."
    s = out["passage"]["start"] - 1000
    assert text[s : out["passage"]["end"] - 1000] == "The Eiffel Tower is in Paris."
    assert "<mark>Eiffel</mark>" in out["highlighted"] and "<mark>Tower</mark>" in out["highlighted"]
    assert all(1000 <= h["start"] < h["end"] <= chunk.end for h in out["highlights"])


def test_highlight_escapes_html() -> None:
    chunk = Chunk("x", "x", "<script>alert(1)</script> tower")
    assert "<script>" not in highlight("tower", chunk)["highlighted"]


def test_a_source_cited_by_its_title_resolves_to_it() -> None:
    tracker = CitationTracker(chunks())
    got = tracker.feed("The capital is Berlin [Germany]. Not a source: [Spain], [note].")
    got += tracker.finish()
    assert [(c.index, c.document_id) for c in got] == [(2, "b")]
    assert tracker.by_title == 1 and tracker.invalid == []
    tracker = CitationTracker(chunks())
    assert [c.index for c in tracker.feed("see [the france] and [2]")] == [1, 2]


def test_attribution_survives_a_rambling_answer() -> None:
    # The first sentence is drawn from a source; the rest is the model's own repetition.
    answer = (
        "The capital of Germany is Berlin. Many people like travelling and seeing museums, "
        "parks, rivers, bridges, trains, mountains, lakes and forests every single summer holiday."
    )
    found = attribute(answer, chunks())
    assert [(c.document_id, c.kind) for c in found] == [("b", "attributed")]
