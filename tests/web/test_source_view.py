"""The cited source in a real browser (Debian chromium): a PDF citation opens the cited page in
the bundled pdf.js viewer with the cited sentence highlighted; other documents open as their
text with headings, the cited sentence marked. The APIs are doubled; the PDF is a real one."""

from __future__ import annotations

import re
from typing import Any

from services.retrieval.core.parsing import parse_file
from tests.helpers.documents import SOLAR_TITLE, solar_pdf
from tests.web.test_frontend import BASE_ROUTES, KEY, double_api, sign_in, site  # noqa: F401

SENTENCE = "Its Great Red Spot is a storm larger than Earth."


def _conversation(citation: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "c-1",
        "messages": [
            {"role": "user", "content": "What is the Great Red Spot?"},
            {"role": "assistant", "content": "A storm larger than Earth [1].", "citations": [citation]},
        ],
    }


def _open_citation(page: Any, url: str, routes: dict[str, Any], pdf: Any = None) -> Any:
    """Open the conversation's citation; ``pdf``: the route handler of the original PDF."""
    double_api(page, {**BASE_ROUTES, **routes})
    if pdf is not None:
        # after the JSON doubles, so it answers first
        page.route(
            re.compile(r".*/api/retrieval/v1/collections/handbook/originals/solar\.pdf(\?page=\d+)?$"), pdf
        )
    sign_in(page, url)
    page.goto(f"{url}/#/chat/c-1")
    page.locator(".chip").click()
    dialog = page.get_by_role("dialog")
    dialog.wait_for()
    return dialog


def test_a_pdf_citation_opens_its_page_with_the_sentence_highlighted(page: Any, site: str) -> None:  # noqa: F811
    pdf = solar_pdf()
    doc = parse_file("solar.pdf", pdf)[0]
    start = doc.text.index(SENTENCE)
    chunk_start = doc.text.index("## Jupiter")
    citation = {
        "index": 1,
        "chunk_id": "c2",
        "document_id": "solar.pdf",
        "title": "solar.pdf",
        "text": doc.text[chunk_start : start + len(SENTENCE)],
        "start": chunk_start,
        "end": start + len(SENTENCE),
        "kind": "cited",
        "page": 2,
        "section": f"{SOLAR_TITLE} > Jupiter",
        "span": {"start": start, "end": start + len(SENTENCE), "text": SENTENCE},
    }
    asked: list[str | None] = []

    def original(route: Any) -> None:
        asked.append(route.request.headers.get("authorization"))
        route.fulfill(status=200, content_type="application/pdf", body=pdf)

    dialog = _open_citation(
        page,
        site,
        {
            r"GET /v1/conversations/c-1": lambda r: (200, _conversation(citation)),
            r"GET /api/retrieval/v1/collections/handbook/documents/solar.pdf": lambda r: (
                200,
                {"id": "solar.pdf", "text": doc.text},
            ),
        },
        pdf=original,
    )
    page.wait_for_function("document.querySelectorAll('.pdf-hit').length > 0", timeout=30_000)
    assert asked and asked[-1] == f"Bearer {KEY}"
    assert dialog.locator(".pdf-label").inner_text() == "Page 2 of 3"
    assert dialog.locator(".pdf-page").get_attribute("data-page") == "2"
    hits = " ".join(dialog.locator(".pdf-hit").evaluate_all("els => els.map(e => e.dataset.text)"))
    assert "Great Red Spot" in hits and "Saturn" not in hits
    # pdf.js drew the page: the canvas is not blank
    inked = page.evaluate(
        """() => { const c = document.querySelector('.pdf-canvas');
                   const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                   let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i] < 128) n++; return n; }"""
    )
    assert inked > 100
    # and the text view below marks the same sentence, under its heading
    page.wait_for_function(f"document.querySelector('mark.cited')?.textContent === {SENTENCE!r}")
    assert "page 2" in dialog.locator(".cite-meta").inner_text()
    assert "Jupiter" in dialog.locator(".passage .doc-heading").all_inner_texts()
    assert page.page_errors == []


def test_a_markdown_citation_opens_its_text_with_headings(page: Any, site: str) -> None:  # noqa: F811
    text = "# Handbook\n\nWelcome.\n\n## Leave\n\nStaff get 25 days of paid leave. Ask your manager first."
    start = text.index("Staff get")
    end = start + len("Staff get 25 days of paid leave.")
    citation = {
        "index": 1,
        "chunk_id": "c1",
        "document_id": "handbook.md",
        "title": "handbook.md",
        "text": text[text.index("## Leave") :],
        "start": text.index("## Leave"),
        "end": len(text),
        "section": "Handbook > Leave",
        "span": {"start": start, "end": end, "text": text[start:end]},
    }
    dialog = _open_citation(
        page,
        site,
        {
            r"GET /v1/conversations/c-1": lambda r: (200, _conversation(citation)),
            r"GET /api/retrieval/v1/collections/handbook/documents/handbook.md": lambda r: (
                200,
                {"id": "handbook.md", "text": text},
            ),
        },
    )
    page.wait_for_function("document.querySelector('.passage .doc-heading') !== null")
    assert dialog.locator(".passage mark.cited").inner_text() == "Staff get 25 days of paid leave."
    assert dialog.locator(".passage h3.doc-heading").inner_text() == "Handbook"
    assert dialog.locator(".passage h4.doc-heading").inner_text() == "Leave"
    assert "section Handbook > Leave" in dialog.locator(".cite-meta").inner_text()
    assert dialog.locator(".pdf-view").is_hidden()  # no page: no PDF viewer
    assert page.page_errors == []


def test_search_results_say_where_the_passage_is(page: Any, site: str) -> None:  # noqa: F811
    hit = {
        "chunk_id": "c3",
        "document_id": "solar.pdf",
        "title": "solar.pdf",
        "text": "Titan is the largest moon of Saturn.",
        "score": 1.0,
        "scores": {"sparse": 1.0},
        "metadata": {},
        "start": 210,
        "end": 246,
        "section": f"{SOLAR_TITLE} > Saturn",
        "pages": [3],
        "anchor": None,
    }
    double_api(
        page,
        {
            **BASE_ROUTES,
            r"POST /api/retrieval/v1/collections/handbook/search": lambda r: (200, {"results": [hit]}),
        },
    )
    sign_in(page, site)
    page.goto(f"{site}/#/search")
    page.wait_for_function("document.querySelector('#search-collection option') !== null")
    page.locator("#search-query").fill("Titan")
    page.get_by_role("button", name="Search").click()
    where = page.locator(".result .where")
    where.wait_for()
    assert where.inner_text() == f"section {SOLAR_TITLE} > Saturn · page 3"
    assert page.page_errors == []
