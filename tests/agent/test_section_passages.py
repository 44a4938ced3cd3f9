"""What the model reads of a hit when the retriever asks for sections: the enclosing section's
text and offsets, and one passage per stretch of a document."""

from __future__ import annotations

from services.agent.chunks import Chunk
from services.agent.locate import cited_sentence
from services.agent.pipelines.components import distinct_passages

DOC = "# Setup\n\nRun `make up` first. It starts the stack.\n\nThe key is in `$TANDEM_HOME/api-key`.\n"


def hit(start: int, end: int, *, section: bool, doc: str = "ops.md") -> dict[str, object]:
    item: dict[str, object] = {"chunk_id": f"{doc}#{start}", "document_id": doc, "text": DOC[start:end]}
    item |= {"start": start, "end": end, "score": 1.0}
    if section:
        item |= {"section_text": DOC, "section_text_start": 0}
    return item


def test_a_hit_with_its_section_reads_and_cites_the_section() -> None:
    key = DOC.index("The key")
    chunk = Chunk.from_result(hit(key, len(DOC), section=True))
    assert (chunk.text, chunk.start, chunk.end) == (DOC, 0, len(DOC))
    # a claim drawn from outside the ranked chunk is located in the document all the same
    s, e = cited_sentence(chunk.text, chunk.start, "Run make up first")
    assert DOC[s:e] == "Run `make up` first."
    plain = Chunk.from_result(hit(key, len(DOC), section=False))
    assert (plain.start, plain.text) == (key, DOC[key:])


def test_hits_of_one_section_become_one_passage_and_other_documents_stay() -> None:
    first = Chunk.from_result(hit(DOC.index("The key"), len(DOC), section=True))
    second = Chunk.from_result(hit(DOC.index("Run"), DOC.index("The key"), section=True))
    other = Chunk.from_result(hit(0, 20, section=True, doc="agent.md"))
    apart = Chunk(chunk_id="x", document_id="ops.md", text="later", start=len(DOC) + 10, end=len(DOC) + 15)
    kept = distinct_passages([first, second, other, apart])
    assert [c.chunk_id for c in kept] == [first.chunk_id, other.chunk_id, "x"]
