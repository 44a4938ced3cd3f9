"""benchmarks/documents: the scan it makes, how it scores retrieval by page, and its question sets."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.answers.sets import DOCUMENT_SETS, DOCUMENT_SETS_DIR, SETS, chosen_sets, get_set
from benchmarks.documents.measure import Chunk, relevant_chunks
from services.cli.eval_questions import Question, load_questions
from services.common.ranking import ndcg_at
from tests.helpers.documents import SOLAR_PAGES, solar_pdf


def test_a_scan_keeps_every_page_and_its_size_but_no_text(tmp_path: Path) -> None:
    import pypdfium2 as pdfium
    from pypdf import PdfReader

    from benchmarks.documents.made import scan_pdf

    src = tmp_path / "guide.pdf"
    src.write_bytes(solar_pdf())
    assert "Jupiter" in (PdfReader(str(src)).pages[1].extract_text() or "")
    dst = tmp_path / "scanned" / "guide.pdf"
    assert scan_pdf(src, dst, dpi=100) == len(SOLAR_PAGES)
    reader = PdfReader(str(dst))
    assert len(reader.pages) == len(SOLAR_PAGES)
    assert all(not (page.extract_text() or "").strip() for page in reader.pages)
    assert all(len(page.images) == 1 for page in reader.pages)
    original, scan = pdfium.PdfDocument(str(src)), pdfium.PdfDocument(str(dst))
    for a, b in zip(original, scan, strict=True):
        assert a.get_size() == pytest.approx(b.get_size(), abs=1.0)  # points, at any dpi
    # the page is still there to read: dark text pixels on a light page
    image = scan[1].render(scale=1).to_pil().convert("L")
    assert min(image.getdata()) < 100 < max(image.getdata())


def _chunk(cid: str, doc: str, *pages: int) -> Chunk:
    return Chunk(cid, {"document_id": doc, "title": doc, "metadata": {}}, pages)


def test_the_relevant_chunks_are_the_source_documents_chunks_on_the_cited_page() -> None:
    q = Question(id="q", question="Which planet?", answers=["Jupiter"], source="guide.pdf", page=2)
    chunks = [
        _chunk("a", "guide.pdf", 1),
        _chunk("b", "guide.pdf", 1, 2),  # runs over onto the page
        _chunk("c", "guide.pdf", 2),
        _chunk("d", "other.pdf", 2),  # the same page of another document
        _chunk("e", "guide.pdf", 3),
    ]
    rel = relevant_chunks(q, chunks)
    assert rel == {"b": 1, "c": 1}
    assert ndcg_at(["c", "b", "a"], rel, 10) == pytest.approx(1.0)
    assert ndcg_at(["a", "d", "e"], rel, 10) == 0.0
    assert 0.0 < ndcg_at(["a", "c", "e"], rel, 10) < 1.0
    also = Question(
        id="r", question="Which?", answers=["x"], source="guide.pdf", also_in=["other.pdf"], page=2
    )
    assert set(relevant_chunks(also, chunks)) == {"b", "c", "d"}


def test_the_document_sets_load_apart_from_the_answers_groups() -> None:
    assert {"debian-reference-tables-pdf", "postgresql-two-columns-pdf", "octave-refcard-pdf"} <= set(
        DOCUMENT_SETS
    )
    groups = set(chosen_sets("all")) | set(chosen_sets("tuning")) | set(chosen_sets("test"))
    assert not groups & set(DOCUMENT_SETS)
    assert groups == set(SETS)
    for name, qs in DOCUMENT_SETS.items():
        assert get_set(name) is qs
        assert qs.questions.parent == DOCUMENT_SETS_DIR
    two = DOCUMENT_SETS["postgresql-two-columns-pdf"]
    assert two.made == "two-columns" and two.made_from == ("continuous-archiving.html",)
    assert two.root.parts[-2:] == ("made", "postgresql-two-columns-pdf")  # made, not unpacked
    assert two.source_root.parts[-1] == "html" and "postgresql-doc-15" in two.source_root.parts


@pytest.mark.parametrize("name", sorted(DOCUMENT_SETS))
def test_each_document_set_has_25_answerable_a_fifth_unanswerable_each_with_its_page(name: str) -> None:
    qs = load_questions(DOCUMENT_SETS[name].questions)
    answerable = [q for q in qs if q.answerable]
    assert len(answerable) >= 25
    assert len(qs) - len(answerable) >= len(qs) / 5
    assert all(q.page and q.section and q.kind and q.answers for q in answerable)
    assert {q.source for q in answerable} == set(DOCUMENT_SETS[name].files)


def test_throughput_counts_the_pages_the_sandboxed_parser_reads(tmp_path: Path) -> None:
    from benchmarks.documents.throughput import measure

    path = tmp_path / "guide.pdf"
    path.write_bytes(solar_pdf())
    got = measure({"born-digital": path}, {"this": None}, runs=1)["this"]["born-digital"]
    assert got["pages"] == len(SOLAR_PAGES)
    assert got["runs"][0]["characters"] > 0 and "error" not in got["runs"][0]
    assert got["pages_per_minute"] == pytest.approx(len(SOLAR_PAGES) / got["median_s"] * 60)
