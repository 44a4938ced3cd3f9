"""Citations a person can check: the cited sentence's span in the document, its PDF page, and
the section path, from the fields of the retrieval hit."""

from __future__ import annotations

from services.agent.chunks import Chunk
from services.agent.citations import CitationTracker, attribute
from services.agent.events import CitationEvent
from services.agent.locate import claim_before

# A document of two PDF pages; one chunk spans the page break.
DOC = (
    "# Guide\n## Jupiter\nJupiter is the largest planet of all.\nIts Great Red Spot is a storm.\n\n"
    "## Saturn\nSaturn has bright rings made of ice.\nTitan is the largest moon of Saturn."
)
PAGE2 = DOC.index("## Saturn")


def pdf_hit() -> dict:
    start = DOC.index("## Jupiter")
    return {
        "chunk_id": "c1",
        "document_id": "solar.pdf",
        "title": "solar.pdf",
        "text": DOC[start:],
        "start": start,
        "end": len(DOC),
        "score": 1.0,
        "section": "Guide > Jupiter",
        "pages": [1, 2],
        "page_starts": [start, PAGE2],
    }


def test_a_cited_sentence_knows_its_span_and_page() -> None:
    chunk = Chunk.from_result(pdf_hit())
    tracker = CitationTracker([chunk])
    tracker.feed("Saturn's biggest moon is Titan [1]. Jupiter is huge [1].")
    tracker.finish()
    (cite,) = tracker.citations
    assert cite.span is not None
    # the answer's sentence before the first marker picks the chunk's sentence about Titan
    assert cite.span.text == "Titan is the largest moon of Saturn."
    assert DOC[cite.span.start : cite.span.end] == cite.span.text
    assert cite.page == 2  # the sentence is on the second page, though the chunk starts on the first
    assert cite.section == "Guide > Jupiter"
    event = CitationEvent.from_citation(cite).model_dump()
    assert event["page"] == 2 and event["span"]["start"] == cite.span.start


def test_the_first_page_and_a_heading_is_never_the_cited_sentence() -> None:
    chunk = Chunk.from_result(pdf_hit())
    tracker = CitationTracker([chunk])
    tracker.feed("The largest planet is Jupiter [1].")
    tracker.finish()
    cite = tracker.citations[0]
    assert cite.span is not None and cite.span.text == "Jupiter is the largest planet of all."
    assert cite.page == 1
    # no words in common: the chunk's first sentence, not its heading line
    quiet = CitationTracker([chunk])
    quiet.feed("Nothing alike [1].")
    quiet.finish()
    other = quiet.citations[0]
    assert other.span is not None and other.span.text == "Jupiter is the largest planet of all."


def test_html_sections_and_anchors_and_hits_without_structure() -> None:
    html = Chunk.from_result(
        {
            "chunk_id": "h",
            "document_id": "ops.html",
            "text": "## Rollback\nRoll back with one command.",
            "start": 40,
            "end": 79,
            "section": "Operations > Rollback",
            "anchor": "rollback",
        }
    )
    plain = Chunk.from_result(
        {"chunk_id": "p", "document_id": "n", "text": "Plain words. Rivers flow.", "start": 5}
    )
    tracker = CitationTracker([html, plain])
    tracker.feed("Use one command to roll back [1]. Rivers flow downhill [2].")
    tracker.finish()
    first, second = tracker.citations
    assert (first.section, first.anchor, first.page) == ("Operations > Rollback", "rollback", None)
    assert first.span is not None and (first.span.start, first.span.end) == (52, 79)
    # a hit of before these fields: no page or section, the span still located
    assert second.section is None and second.page is None and second.anchor is None
    assert second.span is not None and second.span.text == "Rivers flow." and second.span.start == 18
    # the chunk round-trips the fields for search pipelines
    assert html.to_result()["anchor"] == "rollback" and "pages" not in html.to_result()


def test_attributed_citations_locate_the_matching_sentence() -> None:
    chunk = Chunk.from_result(pdf_hit())
    (cite,) = attribute("Saturn has bright rings made of ice.", [chunk])
    assert cite.kind == "attributed" and cite.span is not None
    assert cite.span.text == "Saturn has bright rings made of ice." and cite.page == 2


def test_claim_before_a_marker() -> None:
    text = "First fact here. Second fact [2] and more [1]."
    assert claim_before(text, text.index("[2]")) == "Second fact"
    assert claim_before(text, text.index("[1]")) == "Second fact and more"
    assert claim_before("Only one.", 9) == "Only one"
