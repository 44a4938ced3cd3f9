"""Structure-aware parsing and chunking: PDF pages and headings, Markdown and HTML section
paths and anchors, DOCX reading order, code blocks and tables kept whole."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from services.common.chunking import atomic_blocks, regex_offsets
from services.retrieval.core.chunking import make_chunks
from services.retrieval.core.parsing import ParseLimits, parse_file
from services.retrieval.core.sandbox import parse_isolated
from tests.helpers.documents import SOLAR_PAGES, SOLAR_TITLE, lines_pdf, solar_pdf


def _page_of(doc_text: str, pages: list[list[int]], needle: str) -> int:
    at = doc_text.index(needle)
    return max(p for p, start in pages if start <= at)


def test_pdf_keeps_pages_and_headings() -> None:
    doc = parse_file("solar.pdf", solar_pdf())[0]
    assert doc.structure["pages"][0] == [1, 0]
    assert [p for p, _ in doc.structure["pages"]] == [1, 2, 3]
    # larger type became headings: the title level 1, page headings level 2
    assert doc.text.startswith(f"# {SOLAR_TITLE}\n## Overview\n")
    for n, (heading, lines) in enumerate(SOLAR_PAGES, start=1):
        assert f"## {heading}" in doc.text
        for line in lines:
            assert _page_of(doc.text, doc.structure["pages"], line) == n, line
    chunks = make_chunks(doc.id, doc.text, title=doc.title, size=12, overlap=0, structure=doc.structure)
    by_text = {c.text: c for c in chunks}
    jupiter = next(c for t, c in by_text.items() if "Great Red Spot" in t)
    assert jupiter.structure["pages"] == [2]
    assert jupiter.structure["section"] == f"{SOLAR_TITLE} > Jupiter"
    assert jupiter.context == f"solar.pdf > {SOLAR_TITLE} > Jupiter"
    saturn = next(c for t, c in by_text.items() if "Titan" in t)
    assert saturn.structure["pages"] == [3] and saturn.structure["page_starts"][0] == saturn.start
    # one chunk across a page break knows both pages and where the second begins
    whole = make_chunks(doc.id, doc.text, size=4096, overlap=0, structure={"pages": doc.structure["pages"]})
    spanning = [c for c in whole if len(c.structure.get("pages", [])) > 1]
    for c in spanning:
        pages, starts = c.structure["pages"], c.structure["page_starts"]
        assert starts == sorted(starts) and starts[0] == c.start
        assert dict(doc.structure["pages"])[pages[1]] == starts[1]


def test_pdf_running_heads_and_page_numbers_are_left_out() -> None:
    doc = parse_file("solar.pdf", solar_pdf(running=True))[0]
    plain = parse_file("solar.pdf", solar_pdf())[0]
    assert "Solar guide" not in doc.text and doc.text == plain.text  # as if never printed
    assert doc.structure["pages"] == plain.structure["pages"]
    # a head on fewer pages than RUNNING_MIN_PAGES is text like any other
    from services.retrieval.core.parsing import _without_running_heads

    two = ["Guide 1\nThe Sun is a star.", "Guide 2\nJupiter is large."]
    assert _without_running_heads(two) == two
    assert _without_running_heads([*two, "Guide 3\nSaturn has rings.\n3"])[2] == "Saturn has rings."


def test_pdf_structure_survives_the_sandboxed_worker(tmp_path: Path) -> None:
    path = tmp_path / "upload.bin"
    path.write_bytes(solar_pdf())
    # the child process with today's limits parses it; the pages come back with the text
    doc = parse_isolated(path, "solar.pdf", ParseLimits(max_pages=5, timeout_s=60))[0]
    assert [p for p, _ in doc.structure["pages"]] == [1, 2, 3]
    assert _page_of(doc.text, doc.structure["pages"], "Titan is the largest moon") == 3


MARKDOWN = b"""# Handbook

Welcome to the team.

## Setup

Install the tools first.

```bash
# not a heading: inside a fence
make install
make test
```

### Database

| name | port |
|------|------|
| postgres | 5432 |
| valkey | 6379 |

Done with the database.
"""


def test_markdown_sections_code_and_tables() -> None:
    doc = parse_file("handbook.md", MARKDOWN)[0]
    assert "```bash\n# not a heading: inside a fence\nmake install\nmake test\n```" in doc.text
    assert "| name | port |\n| postgres | 5432 |\n| valkey | 6379 |" in doc.text
    # small chunks (each block fits in 20 words, the section does not): blocks still come whole
    chunks = make_chunks(doc.id, doc.text, size=20, overlap=3, structure=doc.structure)
    fence = doc.text.index("```bash")
    fence_end = doc.text.index("```\n", fence + 3) + 3
    table = doc.text.index("| name")
    table_end = doc.text.index("6379 |") + len("6379 |")
    for start, end in ((fence, fence_end), (table, table_end)):
        holders = [c for c in chunks if c.start <= start and c.end >= end]
        assert holders, f"no chunk holds {doc.text[start:end]!r}"
        # and no chunk cuts into the block
        for c in chunks:
            assert not (start < c.start < end) and not (start < c.end < end), (c.text, doc.text[start:end])
    sections = {c.structure["section"] for c in chunks}
    assert sections == {"Handbook", "Handbook > Setup", "Handbook > Setup > Database"}
    db = next(c for c in chunks if "postgres" in c.text)
    assert db.structure["headings"] == ["Handbook", "Setup", "Database"]
    assert doc.text[db.structure["section_start"] :].startswith("### Database")


def test_a_block_longer_than_a_chunk_is_still_cut() -> None:
    code = "```\n" + "\n".join(f"line {i} of code" for i in range(40)) + "\n```"
    text = f"Intro words here.\n\n{code}\n\nAfter."
    assert atomic_blocks(text) == [(text.index("```"), text.rindex("```") + 3)]
    chunks = make_chunks("d", text, size=16, overlap=0)
    assert len(chunks) > 3 and "".join(c.text for c in chunks).count("line") == 40


HTML = b"""<html><head><title>Ops</title></head><body>
<h1 id="ops">Operations</h1><p>Runbooks for the team.</p>
<section id="deploy"><h2>Deploy</h2><p>Deploy   with the pipeline.</p>
<pre>kubectl apply -f app.yaml
  --namespace prod</pre>
<table><tr><th>env</th><th>replicas</th></tr><tr><td>prod</td><td>3</td></tr></table></section>
<h2><a name="rollback"></a>Rollback</h2><p>Roll back with one command.</p>
<h2>Contacts</h2><p>Ask the on-call person.</p>
</body></html>"""


def test_html_sections_anchors_code_and_tables() -> None:
    doc = parse_file("ops.html", HTML)[0]
    assert "```\nkubectl apply -f app.yaml\n  --namespace prod\n```" in doc.text  # spacing kept
    assert "| env | replicas |\n| prod | 3 |" in doc.text
    assert "Deploy with the pipeline." in doc.text  # prose spacing normalised
    chunks = make_chunks(doc.id, doc.text, size=64, overlap=0, structure=doc.structure)
    by_section = {c.structure["section"]: c for c in chunks}
    assert by_section["Operations"].structure["anchor"] == "ops"
    assert by_section["Operations > Deploy"].structure["anchor"] == "deploy"  # the section's id
    assert by_section["Operations > Rollback"].structure["anchor"] == "rollback"  # <a name>
    assert "anchor" not in by_section["Operations > Contacts"].structure  # none of its own
    deploy = by_section["Operations > Deploy"]
    assert "kubectl apply" in deploy.text and "| prod | 3 |" in deploy.text


FAQ = b"""<html><head><title>FAQ</title></head><body><h1>Frequently Asked Questions</h1><p>Answers.</p>
<table><tr class="qandadiv"><td colspan="2"><h3><a name="faq.background"></a>1. Background</h3></td></tr>
<tr><td>1.1.</td><td>Where does the name come from?</td></tr><tr><td></td><td>From a pencil band.</td></tr>
<tr class="qandadiv"><td colspan="2"><h3>2. Building</h3></td></tr>
<tr><td>2.1.</td><td>What provides the missing header?</td></tr>
<tr><td></td><td>Install the quorzip-devel package.
<table><tr><th>distro</th><th>name</th></tr><tr><td>Fedora</td><td>quorzip-static</td></tr></table></td></tr>
</table></body></html>"""


def test_an_html_table_that_holds_headings_is_the_pages_layout() -> None:
    # DocBook's FAQ: the headings and the questions are rows of one table; the headings open
    # sections, and a data table inside a cell stays a table
    doc = parse_file("faq.html", FAQ)[0]
    assert "### 2. Building" in doc.text and "| 2.1. |" not in doc.text
    assert "2.1. What provides the missing header?" in doc.text
    assert "Install the quorzip-devel package." in doc.text
    assert "| distro | name |\n| Fedora | quorzip-static |" in doc.text
    chunks = make_chunks(doc.id, doc.text, size=64, overlap=0, structure=doc.structure)
    sections = {c.structure["section"] for c in chunks if "quorzip-devel" in c.text}
    assert sections == {"Frequently Asked Questions > 2. Building"}
    background = next(c for c in chunks if "pencil band" in c.text)
    assert background.structure["anchor"] == "faq.background"


def test_docx_keeps_reading_order_of_tables() -> None:
    from docx import Document

    d = Document()
    d.add_heading("Pricing", level=1)
    d.add_paragraph("Plans are billed monthly.")
    table = d.add_table(rows=2, cols=2)
    for r, row in enumerate([("plan", "price"), ("team", "20")]):
        for c, value in enumerate(row):
            table.cell(r, c).text = value
    d.add_heading("Support", level=1)
    d.add_paragraph("Email us any time.")
    buf = io.BytesIO()
    d.save(buf)
    doc = parse_file("pricing.docx", buf.getvalue())[0]
    assert doc.text.index("| team | 20 |") < doc.text.index("# Support")  # in place, not at the end
    chunks = make_chunks(doc.id, doc.text, size=64, overlap=0)
    table_chunk = next(c for c in chunks if "| plan | price |" in c.text)
    assert table_chunk.structure["section"] == "Pricing" and "| team | 20 |" in table_chunk.text


def test_a_section_window_grows_around_its_chunk_within_the_section() -> None:
    from services.retrieval.core.structure import section_window

    text = "# A\n\none two three four five six seven eight nine ten\n\n# B\n\nother words"
    lo, hi = 0, text.index("# B")
    start, end = text.index("five"), text.index("five") + len("five six")
    # 6 tokens: the chunk's 2 and 2 on each side, never past the section
    s, e = section_window(text, lo, hi, start, end, 6, regex_offsets)
    assert text[s:e] == "three four five six seven eight"
    s, e = section_window(text, lo, hi, start, end, 100, regex_offsets)
    assert text[s:e] == text[lo:hi].strip()
    # a budget below the chunk's own length: the chunk alone
    assert section_window(text, lo, hi, start, end, 1, regex_offsets) == (start, end)


def _hash_lines_pdf() -> bytes:
    return lines_pdf(
        [
            ("Helvetica-Bold", 16, 780, "Installing the relay"),
            ("Helvetica", 10, 750, "Become root, then fetch the package index and install the relay."),
            ("Helvetica", 10, 738, "Each step"),
            ("Courier", 10, 720, "# apt-get install relayd"),
            ("Helvetica", 10, 700, "The relay starts at boot once installed."),
            ("Helvetica", 10, 688, "It listens on port 7400."),
        ]
    )


def _hash_lines_docx() -> bytes:
    from docx import Document

    d = Document()
    d.add_heading("Installing the relay", level=1)
    d.add_paragraph("Become root, then fetch the package index and install the relay.")
    d.add_paragraph("# apt-get install relayd")
    d.add_paragraph("The relay starts at boot once installed. It listens on port 7400.")
    buf = io.BytesIO()
    d.save(buf)
    return buf.getvalue()


HASH_HTML = b"""<html><body><h1>Installing the relay</h1>
<p>Become root, then fetch the package index and install the relay.</p><p># apt-get install relayd</p>
<pre># relayd.conf
port 7400</pre><p>The relay starts at boot once installed. It listens on port 7400.</p></body></html>"""


@pytest.mark.parametrize("name", ["relay.pdf", "relay.html", "relay.docx"])
def test_a_line_of_text_that_begins_with_a_hash_opens_no_section(name: str) -> None:
    # a root prompt or a comment in the document's own text: a line, not a heading
    data = {"relay.pdf": _hash_lines_pdf, "relay.html": lambda: HASH_HTML, "relay.docx": _hash_lines_docx}[
        name
    ]()
    doc = parse_file(name, data)[0]
    assert "# Installing the relay" in doc.text and "# apt-get install relayd" in doc.text
    chunks = make_chunks(doc.id, doc.text, size=512, overlap=0, structure=doc.structure)
    assert {c.structure["section"] for c in chunks} == {"Installing the relay"}
    port = next(c for c in chunks if "port 7400." in c.text)
    assert "apt-get install relayd" in port.text  # the example stays with what it explains
