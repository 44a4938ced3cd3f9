"""PDF text that follows the page: columns read one after the other, ruled tables as Markdown
tables, words hyphenated across a column joined, each line's box stored with the chunks that
hold it (checked against pdfplumber's own reading of the box), encrypted files refused by name,
and pages without a text layer read by OCR or named. The PDFs are drawn here with reportlab."""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from services.common.errors import InvalidRequest
from services.retrieval.core.chunking import make_chunks
from services.retrieval.core.ocr import OcrSettings
from services.retrieval.core.parsing import parse_file, pdf_document
from services.retrieval.core.structure import boxes_of
from tests.helpers.documents import lines_pdf, solar_pdf
from tests.retrieval.conftest import run_queued_job
from tests.retrieval.test_api import make, search

A4 = (595.0, 842.0)
LEFT_X, RIGHT_X, COLUMN = 56.0, 313.0, 226.0  # two columns with a 31 pt gutter
TITLE = "Bridge Monitoring Field Notes"
LEFT = [
    "The north span was fitted with strain gauges in early spring, after the winter inspection "
    "found hairline cracks near the second pier.",
    "Readings are taken every ten minutes and sent over the cellular link to the county office, "
    "where an engineer reviews the daily summary each morning.",
    "Temperature swings explain most of the daily variation, so each reading is corrected with "
    "the air temperature measured under the deck.",
]
# the left column ends in a word broken at its hyphen, which the right column finishes
LEFT_LAST = "Each girder now carries three calibrated sen-"
RIGHT_FIRST = "sors that report the load on the bearings."
RIGHT = [
    "When a heavy truck crosses, the sensors on the outer girder show a short peak that fades "
    "within moments, which matches the design model.",
    "Twice a year the crew climbs under the deck to clean the junction boxes and to replace any "
    "battery that has dropped below its rated voltage.",
    "The next inspection will decide whether the cracks have grown since the gauges went in, "
    "using the stored readings as the baseline.",
]


def _lines(paragraph: str, width: float, font: str = "Helvetica", size: float = 10) -> list[str]:
    from reportlab.lib.utils import simpleSplit

    return list(simpleSplit(paragraph, font, size, width))


def _justified(c: Any, x: float, y: float, line: str, width: float, last: bool) -> None:
    """A line of running text, stretched to the column's width unless it ends its paragraph."""
    from reportlab.pdfbase.pdfmetrics import stringWidth

    text = c.beginText(x, y)
    text.setFont("Helvetica", 10)
    gaps = line.count(" ")
    if not last and gaps:
        text.setWordSpace((width - stringWidth(line, "Helvetica", 10)) / gaps)
    text.textOut(line)
    c.drawText(text)


def _column(c: Any, x: float, y: float, paragraphs: list[str], tail: str = "", head: str = "") -> None:
    lines: list[tuple[str, bool]] = []
    if head:
        lines.append((head, True))
    for p in paragraphs:
        split = _lines(p, COLUMN)
        lines += [(ln, n == len(split) - 1) for n, ln in enumerate(split)]
    if tail:
        lines.append((tail, False))
    for line, last in lines:
        _justified(c, x, y, line, COLUMN, last)
        y -= 12


def two_column_pdf() -> bytes:
    """One A4 page: a title across the page, then two justified columns; the page number at
    its foot."""
    from reportlab.pdfgen import canvas

    buf = io.BytesIO()
    c = canvas.Canvas(buf, pagesize=A4)
    c.setFont("Helvetica-Bold", 16)
    c.drawString(LEFT_X, 780, TITLE)
    _column(c, LEFT_X, 740, LEFT, tail=LEFT_LAST)
    _column(c, RIGHT_X, 740, RIGHT, head=RIGHT_FIRST)
    c.setFont("Helvetica", 9)
    c.drawString(295, 40, "1")
    c.showPage()
    c.save()
    return buf.getvalue()


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_two_columns_are_read_one_after_the_other() -> None:
    doc = parse_file("bridge.pdf", two_column_pdf())[0]
    flat = _flat(doc.text)
    assert doc.text.startswith(f"# {TITLE}\n")
    for p in LEFT + RIGHT:
        assert p in flat, p  # each paragraph whole: no line of the other column inside it
    at = [flat.index(p) for p in LEFT + RIGHT]
    assert at == sorted(at)  # the left column, then the right
    # the word broken across the columns is whole again, the page number left out
    assert "Each girder now carries three calibrated sensors that report the load" in flat
    assert not re.search(r"(?m)^1$", doc.text)
    lines = doc.structure["lines"]
    lefts = [ln for ln in lines if doc.text[ln[0] : ln[1]] in _lines(LEFT[0], COLUMN)]
    rights = [ln for ln in lines if doc.text[ln[0] : ln[1]] in _lines(RIGHT[1], COLUMN)]
    assert lefts and rights
    assert all(abs(ln[3] - LEFT_X) < 1 for ln in lefts) and all(abs(ln[3] - RIGHT_X) < 1 for ln in rights)


def definition_list_pdf() -> bytes:
    """Options and their descriptions side by side, each row a line, no rules: a gap that is no
    gutter between columns of running text."""
    from reportlab.pdfgen import canvas

    rows = [
        ("--verbose", "print every step as it runs"),
        ("--quiet", "print errors only"),
        ("--dry-run", "show what would change and change nothing"),
        ("-n COUNT", "stop after COUNT files"),
        ("--force", "overwrite files that exist"),
        ("--config FILE", "read settings from FILE"),
        ("--jobs N", "run N copies at once"),
        ("--help", "show this text"),
    ]
    buf = io.BytesIO()
    c = canvas.Canvas(buf, pagesize=A4)
    c.setFont("Helvetica", 10)
    y = 760.0
    for option, description in rows:
        c.drawString(72, y, option)
        c.drawString(200, y, description)
        y -= 12
    c.showPage()
    c.save()
    return buf.getvalue()


def test_a_list_in_two_columns_keeps_each_term_with_its_description() -> None:
    text = parse_file("options.pdf", definition_list_pdf())[0].text
    assert "--verbose print every step as it runs\n--quiet print errors only\n" in text
    assert "--help show this text" in text


def reference_card_pdf() -> bytes:
    """A landscape page of three columns, each a list of keys and what they do, drawn a column
    at a time as typesetters draw columns; the lines are short and ragged."""
    from reportlab.pdfgen import canvas

    buf = io.BytesIO()
    c = canvas.Canvas(buf, pagesize=(842.0, 595.0))
    for n, (x, column) in enumerate(zip((40.0, 310.0, 580.0), CARD, strict=True)):
        y = 540.0
        c.setFont("Helvetica-Bold", 12)
        c.drawString(x, y, f"Keys {n + 1}")
        for key, action in column:
            y -= 13
            c.setFont("Courier", 9)
            c.drawString(x, y, key)
            c.setFont("Helvetica", 9)
            c.drawString(x + 60, y, action)
    c.showPage()
    c.save()
    return buf.getvalue()


CARD = [
    [
        (f"C-{k}", f"{verb} the {thing}")
        for k, verb, thing in zip(
            "abcdefgh",
            ["open", "close", "save", "print", "mark", "copy", "paste", "undo"],
            ["file", "window", "buffer", "page", "region", "line", "text", "change"],
            strict=True,
        )
    ],
    [
        (f"M-{k}", f"move to the {place}")
        for k, place in zip(
            "abcdefgh",
            ["start", "end", "top", "bottom", "next word", "last word", "next line", "last line"],
            strict=True,
        )
    ],
    [(f"F{k}", f"run macro {k}") for k in range(1, 9)],
]


def test_columns_drawn_one_after_the_other_are_read_so_though_their_lines_are_short() -> None:
    text = parse_file("card.pdf", reference_card_pdf())[0].text
    at = [text.index(f"{key} {action}") for column in CARD for key, action in column]
    assert at == sorted(at)  # each key with its action, the columns one after the other


TABLE = [
    ["Plan", "Monthly limit", "Support"],
    ["Basic", "10 GB", "Email"],
    ["Team", "250 GB", "Email and chat"],
    ["Enterprise", "5 TB", "A named engineer"],
]
BEFORE_TABLE = "The plans differ in storage and in the help that comes with them."
AFTER_TABLE = "Prices are listed on the order form."


def table_pdf(outer: bool = True) -> bytes:
    """A paragraph, a ruled table of ``TABLE`` (a rule above and below each row; lines between
    the columns, and along the table's sides unless not ``outer``), a paragraph."""
    from reportlab.pdfgen import canvas

    xs = [72.0, 200.0, 330.0, 500.0]
    top, row_h = 700.0, 20.0
    ys = [top - n * row_h for n in range(len(TABLE) + 1)]
    buf = io.BytesIO()
    c = canvas.Canvas(buf, pagesize=A4)
    c.setFont("Helvetica", 10)
    c.drawString(72, 740, BEFORE_TABLE)
    c.setLineWidth(0.5)
    for y in ys:
        c.line(xs[0], y, xs[-1], y)
    for x in xs if outer else xs[1:-1]:
        c.line(x, ys[0], x, ys[-1])
    for r, row in enumerate(TABLE):
        c.setFont("Helvetica-Bold" if r == 0 else "Helvetica", 10)
        for x, cell in zip(xs[:-1], row, strict=True):
            c.drawString(x + 4, ys[r] - 14, cell)
    c.setFont("Helvetica", 10)
    c.drawString(72, ys[-1] - 30, AFTER_TABLE)
    c.showPage()
    c.save()
    return buf.getvalue()


MARKDOWN = (
    "| Plan | Monthly limit | Support |\n"
    "| --- | --- | --- |\n"
    "| Basic | 10 GB | Email |\n"
    "| Team | 250 GB | Email and chat |\n"
    "| Enterprise | 5 TB | A named engineer |"
)


@pytest.mark.parametrize("outer", [True, False], ids=["ruled all round", "no outer border"])
def test_a_ruled_table_becomes_a_markdown_table_in_its_place(outer: bool) -> None:
    doc = parse_file("plans.pdf", table_pdf(outer))[0]
    assert f"{BEFORE_TABLE}\n\n{MARKDOWN}\n\n{AFTER_TABLE}" in doc.text
    # each row has its box (the | --- | line has none); the table's words are not also in the text
    rows = [ln for ln in doc.structure["lines"] if doc.text[ln[0] : ln[1]].startswith("|")]
    assert [doc.text[ln[0] : ln[1]] for ln in rows] == [r for r in MARKDOWN.split("\n") if "---" not in r]
    assert doc.text.count("Enterprise") == 1
    chunks = make_chunks(doc.id, doc.text, size=4096, overlap=0, structure=doc.structure)
    assert MARKDOWN in chunks[0].text


def test_line_boxes_hold_the_words_drawn_there() -> None:
    """Each line's box, read back by pdfplumber from the page, holds the words of the line's
    text; a chunk stores the boxes of its lines, clipped to it and counted from its start."""
    import pdfplumber

    for name, data in [
        ("solar.pdf", solar_pdf()),
        ("bridge.pdf", two_column_pdf()),
        ("plans.pdf", table_pdf()),
    ]:
        doc = parse_file(name, data)[0]
        lines = doc.structure["lines"]
        with pdfplumber.open(io.BytesIO(data)) as pdf:
            drawn = [pdf.pages[ln[2] - 1].crop(ln[3:], strict=False).extract_text() for ln in lines]
        joined = {n for n, d in enumerate(drawn) if d.endswith("-")} | {
            n + 1 for n, d in enumerate(drawn) if d.endswith("-")
        }
        for n, (ln, seen) in enumerate(zip(lines, drawn, strict=True)):
            if n not in joined:  # the lines of a word broken in two differ by its pieces
                assert _words(doc.text[ln[0] : ln[1]]) == _words(seen), (name, doc.text[ln[0] : ln[1]], seen)
        assert len(lines) - len(joined) >= 5
        sizes = {s[0]: s[1:] for s in doc.structure["page_sizes"]}
        chunks = make_chunks(doc.id, doc.text, size=12, overlap=3, structure=doc.structure)
        assert len(chunks) > 3
        for chunk in chunks:
            if set(chunk.text) <= set("|- "):
                continue  # a table's | --- | line alone (chunks this small cut tables): no box
            boxes = chunk.structure["boxes"]
            assert boxes and chunk.structure["page_sizes"] == [
                [p, *sizes[p]] for p in sorted({b[2] for b in boxes})
            ]
            for start, end, page, *box in boxes:
                (line,) = [ln for ln in lines if ln[2] == page and ln[3:] == box]
                assert line[0] <= chunk.start + start < chunk.start + end <= line[1]
                assert 0 <= start < end <= len(chunk.text)
                assert chunk.text[start:end] in doc.text[line[0] : line[1]]


def _words(text: str) -> list[str]:
    return re.findall(r"[^\s|#]+", text)


def test_boxes_clip_to_the_chunk_and_count_from_its_start() -> None:
    lines = [[0, 10, 1, 1.0, 2.0, 3.0, 4.0], [11, 20, 1, 1.0, 6.0, 3.0, 8.0], [22, 30, 2, 1.0, 2.0, 3.0, 4.0]]
    assert boxes_of(lines, 5, 15) == [[0, 5, 1, 1.0, 2.0, 3.0, 4.0], [6, 10, 1, 1.0, 6.0, 3.0, 8.0]]
    assert boxes_of(lines, 20, 22) == []
    assert boxes_of(lines, 21, 40) == [[1, 9, 2, 1.0, 2.0, 3.0, 4.0]]


def test_search_hits_carry_the_boxes_of_their_lines(client: httpx.Client) -> None:
    """A PDF through the upload job (parsed in the sandbox), then search: the hit's boxes are on
    its pages, and each holds the words of the hit's span for it."""
    import pdfplumber

    make(client, chunking={"size": 48, "overlap": 0})
    data = two_column_pdf()
    job = run_queued_job(
        client, client.post("/v1/collections/kb/files", files=[("file", ("bridge.pdf", data))])
    )
    assert job["status"] == "succeeded", job
    hit = search(client, query="battery rated voltage junction boxes", mode="sparse", top_k=1)[0]
    assert "battery" in hit["text"] and hit["pages"] == [1]
    assert hit["page_sizes"] == [[1, A4[0], A4[1]]]
    inner = [b for b in hit["boxes"] if b[0] > 0 and b[1] < len(hit["text"])]
    assert inner
    with pdfplumber.open(io.BytesIO(data)) as pdf:
        for start, end, page, *box in inner:
            assert _words(hit["text"][start:end]) == _words(pdf.pages[page - 1].crop(box).extract_text())
    # the right column's lines are boxed where the right column is
    assert all(b[3] > RIGHT_X - 1 for b in hit["boxes"] if "battery" in hit["text"][b[0] : b[1]])


def encrypted(user_password: str) -> bytes:
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(solar_pdf())))
    writer.encrypt(user_password=user_password, owner_password="owner-secret", algorithm="AES-128")
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


def test_an_encrypted_pdf_is_refused_by_name() -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_file("locked.pdf", encrypted("reader-secret"))
    assert err.value.code == "encrypted_pdf" and "'locked.pdf'" in err.value.message
    assert "password" in err.value.message
    # encrypted with an owner password only: every reader opens it, and so does the parser
    doc = parse_file("open.pdf", encrypted(""))[0]
    assert "Titan is the largest moon of Saturn." in doc.text


def scanned_page_pdf(words: str) -> bytes:
    """Two pages: text on the first; on the second only a picture of ``words`` (no text layer)."""
    import os

    import reportlab
    from PIL import Image, ImageDraw, ImageFont
    from reportlab.lib.utils import ImageReader
    from reportlab.pdfgen import canvas

    font = ImageFont.truetype(os.path.join(os.path.dirname(reportlab.__file__), "fonts", "Vera.ttf"), 48)
    img = Image.new("RGB", (1400, 200), "white")
    ImageDraw.Draw(img).text((40, 60), words, fill="black", font=font)
    buf = io.BytesIO()
    c = canvas.Canvas(buf, pagesize=A4)
    c.setFont("Helvetica", 11)
    c.drawString(72, 760, "The first page has a text layer.")
    c.showPage()
    c.drawImage(ImageReader(img), 72, 600, 420, 60)
    c.showPage()
    c.save()
    return buf.getvalue()


SCANNED = "Harbour cranes unload grain"


def test_a_page_without_a_text_layer_is_read_by_ocr() -> None:
    data = scanned_page_pdf(SCANNED)
    doc = parse_file("scan.pdf", data, ocr=OcrSettings())[0]
    page2 = dict(doc.structure["pages"])[2]
    assert _flat(doc.text[page2:]).lower() == SCANNED.lower()
    assert "pages_without_text" not in doc.metadata
    (line,) = [ln for ln in doc.structure["lines"] if ln[2] == 2]
    assert doc.text[line[0] : line[1]] == doc.text[page2:]
    x0, top, x1, bottom = line[3:]
    # the picture is drawn at x 72..492, y 600..660 (from the foot): its words are inside
    assert 72 <= x0 < x1 <= 492 and 842 - 660 <= top < bottom <= 842 - 600


def test_pages_without_text_are_named() -> None:
    data = scanned_page_pdf(SCANNED)
    plain = parse_file("scan.pdf", data)[0]  # no OCR
    assert plain.metadata["pages_without_text"] == [2] and SCANNED not in plain.text
    # OCR that runs out of time on the page: the page has no text, and the reason is kept
    out = pdf_document("scan.pdf", data, ocr=OcrSettings(page_timeout_s=0.0))
    assert out.pages_without_text == [2] and "limit" in out.page_errors[2]
    only_scan = _only_page(data, 2)
    with pytest.raises(InvalidRequest) as err:
        parse_file("scan-only.pdf", only_scan)
    assert err.value.code == "empty_file" and "pages without text: 1" in err.value.message


def _only_page(data: bytes, page: int) -> bytes:
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter()
    writer.add_page(PdfReader(io.BytesIO(data)).pages[page - 1])
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


def _rotated(data: bytes, turn: Callable[[Any], Any]) -> bytes:
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter()
    for page in PdfReader(io.BytesIO(data)).pages:
        writer.add_page(turn(page))
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


def test_a_page_turned_by_its_rotate_key_reads_as_before() -> None:
    """A page shown turned a quarter (``/Rotate 90``): its text reads as it did, each line's box
    on the page as shown (where the lines run down the page)."""
    plain = parse_file("solar.pdf", solar_pdf())[0]
    doc = parse_file("solar.pdf", _rotated(solar_pdf(), lambda p: p.rotate(90)))[0]
    assert doc.text == plain.text
    assert doc.structure["page_sizes"][0][1:] == [841.89, 595.28]
    for (_, _, _, x0, top, x1, bottom), before in zip(
        doc.structure["lines"], plain.structure["lines"], strict=True
    ):
        assert 0 <= x0 < x1 <= 841.89 and 0 <= top < bottom <= 595.28
        assert bottom - top == pytest.approx(before[5] - before[3], abs=0.02)  # turned a quarter
        assert top == pytest.approx(before[3], abs=0.02) and x1 == pytest.approx(841.89 - before[4], abs=0.02)


def landscape_pdf() -> bytes:
    """A wide page as LaTeX's landscape pages are made: the text drawn turned a quarter on a
    tall page, and ``/Rotate 90`` to show it upright."""
    from reportlab.pdfgen import canvas

    buf = io.BytesIO()
    c = canvas.Canvas(buf, pagesize=A4)
    c.translate(A4[0], 0)
    c.rotate(90)  # the page's long side is now the x axis
    c.setFont("Helvetica-Bold", 16)
    c.drawString(72, 500, "Quarterly figures")
    c.setFont("Helvetica", 10)
    for n, line in enumerate(["Sales rose in every region.", "Costs stayed level."]):
        c.drawString(72, 470 - 14 * n, line)
    c.showPage()
    c.save()
    return _rotated(buf.getvalue(), lambda p: p.rotate(90))


def test_a_landscape_page_reads_upright() -> None:
    doc = parse_file("wide.pdf", landscape_pdf())[0]
    assert doc.text == "# Quarterly figures\nSales rose in every region.\nCosts stayed level."
    assert doc.structure["page_sizes"] == [[1, A4[1], A4[0]]]
    title, first, second = doc.structure["lines"]
    for _, _, _, x0, top, x1, bottom in (title, first, second):
        assert x1 - x0 > bottom - top and abs(x0 - 72) < 1  # across the page as shown, at its left
    assert title[4] < first[4] < second[4]


def test_code_keeps_its_indentation() -> None:
    code = ["for item in queue:", "    if item.ready:", "        send(item)"]
    data = lines_pdf(
        [("Helvetica", 10, 760, "Run the loop like this:")]
        + [("Courier", 10, 748 - 12 * n, line) for n, line in enumerate(code)]
    )
    text = parse_file("loop.pdf", data)[0].text
    assert "Run the loop like this:\nfor item in queue:\n    if item.ready:\n        send(item)" in text
