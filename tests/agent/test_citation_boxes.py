"""Line boxes from a retrieval hit to the citation the viewer draws: offsets into the cited text
(moved when the hit's section is what is cited), and absent from citations of sources without."""

from __future__ import annotations

from services.agent.chunks import Chunk, Citation
from services.agent.events import CitationEvent

SECTION = "## Jupiter\nJupiter is the largest planet.\nIts Great Red Spot is a storm larger than Earth.\n"
SECTION_START = 100
# the ranked chunk is the section's two sentences, 11 characters into the section
CHUNK_AT = SECTION.index("Jupiter is")
CHUNK = SECTION[CHUNK_AT:]
LINE1 = len("Jupiter is the largest planet.")


def hit(**more: object) -> dict:
    return {
        "chunk_id": "c1",
        "document_id": "solar.pdf",
        "title": "solar.pdf",
        "text": CHUNK,
        "start": SECTION_START + CHUNK_AT,
        "end": SECTION_START + len(SECTION),
        "score": 1.0,
        "pages": [2],
        "page_starts": [SECTION_START + CHUNK_AT],
        # offsets into the chunk's text (what retrieval stores), boxes in PDF points
        "boxes": [
            [0, LINE1, 2, 72.0, 90.5, 300.25, 104.0],
            [LINE1 + 1, len(CHUNK) - 1, 2, 72.0, 106.0, 410.0, 119.5],
            ["bad", 1, 2, 0, 0, 1, 1],  # a malformed row is dropped, not a 500
        ],
        "page_sizes": [[2, 612, 792]],
        **more,
    }


def test_a_cited_line_keeps_its_box_and_page_size() -> None:
    chunk = Chunk.from_result(hit())
    cite = Citation.of(1, chunk, claim="The Great Red Spot is a storm [1].")
    assert cite.span is not None and cite.span.text == "Its Great Red Spot is a storm larger than Earth."
    assert cite.boxes == [
        [0.0, float(LINE1), 2.0, 72.0, 90.5, 300.25, 104.0],
        [float(LINE1 + 1), float(len(CHUNK) - 1), 2.0, 72.0, 106.0, 410.0, 119.5],
    ]
    assert cite.page_sizes == [[2.0, 612.0, 792.0]]
    # the box whose [start, end) overlaps the span (in the citation's text) is the second line
    rel = (cite.span.start - cite.start, cite.span.end - cite.start)
    hits = [b for b in cite.boxes if b[0] < rel[1] and b[1] > rel[0]]
    assert [b[4] for b in hits] == [106.0]
    sent = CitationEvent.from_citation(cite).model_dump()
    assert sent["boxes"] == cite.boxes and sent["page_sizes"] == [[2.0, 612.0, 792.0]]


def test_boxes_follow_the_text_when_the_section_is_cited() -> None:
    chunk = Chunk.from_result(
        hit(section_text=SECTION, section_text_start=SECTION_START),
    )
    assert chunk.text == SECTION and chunk.start == SECTION_START
    # the boxes now count from the section's start: each still names its own line
    for b in chunk.boxes:
        line = chunk.text[int(b[0]) : int(b[1])]
        assert line in ("Jupiter is the largest planet.", "Its Great Red Spot is a storm larger than Earth.")
    assert chunk.to_result()["boxes"] == chunk.boxes


def test_a_source_without_boxes_keeps_the_citation_shape() -> None:
    plain = {k: v for k, v in hit().items() if k not in ("boxes", "page_sizes")}
    cite = Citation.of(1, Chunk.from_result(plain))
    dumped = cite.model_dump()
    assert "boxes" not in dumped and "page_sizes" not in dumped
    assert "boxes" not in cite.model_dump_json()
    assert "boxes" not in Chunk.from_result(plain).to_result()
