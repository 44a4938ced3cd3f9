"""Decks, sheets, OpenDocument text, e-books and e-mail: each file made in the test by its
format's own library (python-pptx, openpyxl, the csv module, odfpy, EbookLib, the email
package) and read by the real parser; long tables chunked by rows with their header; limits
(zip bombs, cells) and corrupt files as clear errors naming the file."""

from __future__ import annotations

import csv
import datetime as dt
import io
import zipfile
from email.message import EmailMessage

import httpx
import pytest

from services.common.chunking import regex_offsets, table_header
from services.common.errors import InvalidRequest
from services.retrieval.core.chunking import make_chunks
from services.retrieval.core.parsing import MIB, InputDocument, ParseLimitError, ParseLimits, parse_file
from tests.retrieval.conftest import run_queued_job
from tests.retrieval.test_api import make, search
from tests.retrieval.test_files import make_docx, make_pdf, upload

# -- files made by each format's library ------------------------------------------------------


def make_pptx(*, hidden_slide: bool = True) -> bytes:
    from pptx import Presentation
    from pptx.util import Inches

    prs = Presentation()
    intro = prs.slides.add_slide(prs.slide_layouts[1])  # title and content
    intro.shapes.title.text = "Quarterly results"
    body = intro.placeholders[1].text_frame
    body.text = "Revenue grew 12% in the quarter."
    sub = body.add_paragraph()
    sub.text = "Churn fell in every region."
    sub.level = 1
    intro.notes_slide.notes_text_frame.text = "Mention the Berlin office opening."
    plans = prs.slides.add_slide(prs.slide_layouts[5])  # title only
    plans.shapes.title.text = "Storage plans"
    table = plans.shapes.add_table(3, 2, Inches(1), Inches(2), Inches(6), Inches(2)).table
    for r, row in enumerate([("plan", "storage limit"), ("basic", "10 GB"), ("pro", "1 TB")]):
        for c, value in enumerate(row):
            table.cell(r, c).text = value
    if hidden_slide:
        secret = prs.slides.add_slide(prs.slide_layouts[5])
        secret.shapes.title.text = "Draft pricing"
        secret.element.set("show", "0")
    blank = prs.slides.add_slide(prs.slide_layouts[6])  # no title placeholder
    box = blank.shapes.add_textbox(Inches(1), Inches(1), Inches(5), Inches(1))
    box.text_frame.text = "Questions welcome."
    buf = io.BytesIO()
    prs.save(buf)
    return buf.getvalue()


def make_xlsx(rows: int = 2) -> bytes:
    from openpyxl import Workbook

    wb = Workbook()
    prices = wb.active
    prices.title = "Prices"
    prices.append([])  # the used range starts below and right of A1
    prices.append([None, "item", "price", "since"])
    prices.append([None, "apple", 1.5, dt.datetime(2024, 3, 1)])
    prices.append([None, "pear", 2.0, dt.datetime(2024, 3, 1, 12, 30)])
    staff = wb.create_sheet("Staff")
    staff.append(["name", "role"])
    for i in range(rows - 1):
        staff.append([f"person {i}", "engineer"])
    staff.append(["Ada", "CTO"])
    hidden = wb.create_sheet("Salaries")
    hidden.append(["name", "salary"])
    hidden.append(["Ada", 1])
    hidden.sheet_state = "hidden"
    buf = io.BytesIO()
    wb.save(buf)
    return buf.getvalue()


def make_limits_xlsx(rows: int) -> bytes:
    """One sheet, a row per region: a table longer than a small chunk."""
    from openpyxl import Workbook

    wb = Workbook()
    sheet = wb.active
    sheet.title = "Limits"
    sheet.append(["region", "plan", "monthly limit"])
    for i in range(rows):
        sheet.append([f"region{i}", f"plan{i % 3}", f"cap{i}units"])
    buf = io.BytesIO()
    wb.save(buf)
    return buf.getvalue()


def make_csv(rows: list[list[str]], delimiter: str = ",", bom: bool = False) -> bytes:
    out = io.StringIO()
    csv.writer(out, delimiter=delimiter).writerows(rows)
    return (("\ufeff" if bom else "") + out.getvalue()).encode()


def make_odt(*, repeat_rows: int = 1) -> bytes:
    from odf import dc
    from odf.opendocument import OpenDocumentText
    from odf.table import Table, TableCell, TableColumn, TableRow
    from odf.text import H, List, ListItem, P, S

    doc = OpenDocumentText()
    doc.meta.addElement(dc.Title(text="Pump manual"))
    doc.text.addElement(H(outlinelevel=1, text="Setup"))
    para = P(text="Prime the pump")
    para.addElement(S(c=100_000_000))  # a hundred million spaces, claimed in a few bytes
    para.addText("before the first start.")
    doc.text.addElement(para)
    steps = List()
    for text in ("Open the valve.", "Fill the housing."):
        item = ListItem()
        item.addElement(P(text=text))
        steps.addElement(item)
    nested = List()
    inner = ListItem()
    inner.addElement(P(text="Use clean water."))
    nested.addElement(inner)
    steps.childNodes[-1].addElement(nested)
    doc.text.addElement(steps)
    doc.text.addElement(H(outlinelevel=2, text="Limits"))
    table = Table(name="Limits")
    table.addElement(TableColumn(numbercolumnsrepeated=3))
    for n, row in enumerate((("part", "max pressure"), ("valve", "5 bar"), ("hose", "8 bar"))):
        tr = TableRow(numberrowsrepeated=repeat_rows) if n == 2 else TableRow()
        for value in row:
            cell = TableCell()
            cell.addElement(P(text=value))
            tr.addElement(cell)
        tr.addElement(TableCell(numbercolumnsrepeated=1_000_000))  # empty to the sheet's edge
        table.addElement(tr)
    doc.text.addElement(table)
    buf = io.BytesIO()
    doc.save(buf)
    return buf.getvalue()


def make_epub() -> bytes:
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("sea-1")
    book.set_title("Sea stories")
    book.set_language("en")
    first = epub.EpubHtml(title="Loomings", file_name="text/loomings.xhtml", lang="en")
    first.content = (
        "<html><body><p>Call me Ishmael, said the sailor.</p>"
        "<table><tr><th>ship</th><th>captain</th></tr><tr><td>Pequod</td><td>Ahab</td></tr></table>"
        "</body></html>"
    )
    second = epub.EpubHtml(title="The Carpet-Bag", file_name="text/carpet.xhtml", lang="en")
    second.content = "<html><body><h1>The Carpet-Bag</h1><p>I stuffed a shirt or two.</p></body></html>"
    book.add_item(first)
    book.add_item(second)
    book.toc = (
        epub.Link("text/loomings.xhtml", "Loomings", "loomings"),
        epub.Link("text/carpet.xhtml", "The Carpet-Bag", "carpet"),
    )
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    book.spine = ["nav", second, first]  # the spine's order, not the manifest's
    buf = io.BytesIO()
    epub.write_epub(buf, book)
    return buf.getvalue()


DOCX_TYPE = ("application", "vnd.openxmlformats-officedocument.wordprocessingml.document")


def make_message(
    subject: str = "Pump report", body: str = "Hi Bob,\nthe pump report is attached.\n"
) -> EmailMessage:
    msg = EmailMessage()
    msg["From"] = "Ada Lovelace <ada@example.com>"
    msg["To"] = "bob@example.com"
    msg["Date"] = "Tue, 05 Mar 2024 10:00:00 +0000"
    msg["Subject"] = subject
    msg.set_content(body)
    return msg


def make_eml() -> bytes:
    msg = make_message()
    msg.add_alternative("<p>Hi Bob, the <b>pump</b> report is attached.</p>", subtype="html")
    msg.add_attachment(make_docx(), maintype=DOCX_TYPE[0], subtype=DOCX_TYPE[1], filename="report.docx")
    msg.add_attachment(
        make_pdf(["Valve pressure stayed below five bar."]),
        maintype="application",
        subtype="pdf",
        filename="../../scan.pdf",  # a path in a name: only its last part is kept
    )
    msg.add_attachment(
        "Notes written in a caf\u00e9.", subtype="plain", charset="latin-1", filename="notes.txt"
    )
    msg.add_attachment(b"\x00\x01binary", maintype="application", subtype="octet-stream", filename="tool.exe")
    msg.add_attachment(
        b"PK\x03\x04 not a zip", maintype=DOCX_TYPE[0], subtype=DOCX_TYPE[1], filename="broken.docx"
    )
    earlier = make_message("Earlier thread", "The first report said the seals leak.\n")
    earlier.add_attachment("Seal part number 4471.", filename="seals.txt")
    msg.add_attachment(earlier)  # message/rfc822
    return bytes(msg)


# the documents of make_eml(): the message, then its attachments in order, nested ones under theirs
EML_IDS = [
    "mail.eml",
    "mail.eml/report.docx",
    "mail.eml/scan.pdf",
    "mail.eml/notes.txt",
    "mail.eml/Earlier thread.eml",
    "mail.eml/Earlier thread.eml/seals.txt",
]


# -- each format --------------------------------------------------------------------------------


def test_pptx_slide_by_slide_with_tables_notes_and_slide_pages() -> None:
    [doc] = parse_file("deck.pptx", make_pptx())
    assert doc.title == "Quarterly results"
    text = doc.text
    assert text.startswith("# Slide 1: Quarterly results\n\nRevenue grew 12% in the quarter.\n- Churn fell")
    assert "Notes: Mention the Berlin office opening." in text
    assert (
        "# Slide 2: Storage plans\n\n| plan | storage limit |\n| --- | --- |\n| basic | 10 GB |\n| pro | 1 TB |"
        in text
    )
    assert "# Slide 4\n\nQuestions welcome." in text  # no title: the number alone
    # the hidden slide is left out, and counted
    assert "Draft pricing" not in text and doc.hidden_text_removed == 1
    pages = doc.structure["pages"]
    assert [p for p, _ in pages] == [1, 2, 4]
    assert [text[start:].split("\n", 1)[0] for _, start in pages] == [
        "# Slide 1: Quarterly results",
        "# Slide 2: Storage plans",
        "# Slide 4",
    ]
    # a chunk cites its slide as a PDF chunk cites its page
    chunks = make_chunks(doc.id, text, size=64, overlap=0, structure=doc.structure)
    plan = next(c for c in chunks if "10 GB" in c.text)
    assert plan.structure["pages"] == [2] and plan.structure["section"] == "Slide 2: Storage plans"
    [kept] = parse_file("deck.pptx", make_pptx(), keep_hidden_text=True)
    assert "# Slide 3: Draft pricing" in kept.text and kept.hidden_text_removed == 0


def test_xlsx_sheet_by_sheet_as_tables_from_the_first_non_empty_row() -> None:
    [doc] = parse_file("book.xlsx", make_xlsx())
    assert doc.text == (
        "# Sheet: Prices\n\n"
        "| item | price | since |\n| --- | --- | --- |\n"
        "| apple | 1.5 | 2024-03-01 |\n| pear | 2 | 2024-03-01 12:30:00 |\n\n"
        "# Sheet: Staff\n\n"
        "| name | role |\n| --- | --- |\n| person 0 | engineer |\n| Ada | CTO |"
    )
    assert doc.hidden_text_removed == 1  # the hidden sheet
    [kept] = parse_file("book.xlsx", make_xlsx(), keep_hidden_text=True)
    assert "# Sheet: Salaries" in kept.text


def test_csv_and_tsv_with_their_dialects() -> None:
    rows = [["city", "note"], ["Köln", "dom; river"], ["Bonn", 'said "hi"']]
    [semi] = parse_file("cities.csv", make_csv(rows, ";", bom=True))
    assert semi.text == ('| city | note |\n| --- | --- |\n| Köln | dom; river |\n| Bonn | said "hi" |')
    [comma] = parse_file("cities.csv", make_csv(rows))
    assert comma.text == semi.text and comma.title == "cities.csv"
    [tsv] = parse_file("cities.tsv", make_csv(rows, "\t"))
    assert tsv.text == semi.text
    [single] = parse_file("one.csv", b"word\nalpha\nbeta\n")  # one column: nothing to sniff
    assert single.text == "| word |\n| --- |\n| alpha |\n| beta |"


def test_odt_headings_lists_and_tables() -> None:
    [doc] = parse_file("manual.odt", make_odt())
    assert doc.title == "Pump manual"
    assert doc.text.startswith("# Setup\n\nPrime the pump")
    assert "before the first start." in doc.text and len(doc.text) < 400  # the spaces are capped
    assert "- Open the valve.\n- Fill the housing.\n  - Use clean water." in doc.text
    assert (
        "## Limits\n\n| part | max pressure |\n| --- | --- |\n| valve | 5 bar |\n| hose | 8 bar |" in doc.text
    )
    chunks = make_chunks(doc.id, doc.text, size=64, overlap=0)
    assert next(c for c in chunks if "5 bar" in c.text).structure["section"] == "Setup > Limits"


def test_epub_chapters_in_spine_order_titled_from_the_table_of_contents() -> None:
    [doc] = parse_file("sea.epub", make_epub())
    assert doc.title == "Sea stories"
    assert doc.text == (
        "# The Carpet-Bag\n\nI stuffed a shirt or two.\n\n"
        "# Loomings\n\nCall me Ishmael, said the sailor.\n\n| ship | captain |\n| Pequod | Ahab |"
    )  # the navigation page is left out; a chapter with no heading gets its title from the TOC


def test_eml_message_and_its_attachments_are_documents() -> None:
    docs = {d.id: d for d in parse_file("mail.eml", make_eml())}
    assert list(docs) == EML_IDS
    msg = docs["mail.eml"]
    assert msg.title == "Pump report"
    assert msg.text == (
        "From: Ada Lovelace <ada@example.com>\nTo: bob@example.com\n"
        "Date: Tue, 05 Mar 2024 10:00:00 +0000\nSubject: Pump report\n"
        "Attachments: report.docx, scan.pdf, notes.txt, tool.exe, broken.docx, Earlier thread.eml\n\n"
        "Hi Bob,\nthe pump report is attached."
    )
    meta = msg.metadata
    assert meta["from"] == "Ada Lovelace <ada@example.com>" and meta["date"] == "2024-03-05T10:00:00+00:00"
    assert meta["attachments"] == ["report.docx", "scan.pdf", "notes.txt", "Earlier thread.eml"]
    assert meta["attachments_skipped"] == [
        {"name": "tool.exe", "type": "application/octet-stream", "reason": "unsupported type .exe"}
    ]
    [failed] = meta["attachments_failed"]
    assert failed["name"] == "broken.docx" and "'broken.docx' is not a readable DOCX" in failed["error"]
    assert "# Owls" in docs["mail.eml/report.docx"].text  # parsed as the DOCX it is
    assert "five bar" in docs["mail.eml/scan.pdf"].text
    assert docs["mail.eml/notes.txt"].text == "Notes written in a caf\u00e9."  # from latin-1
    earlier = docs["mail.eml/Earlier thread.eml"]
    assert "Subject: Earlier thread" in earlier.text and "seals leak" in earlier.text
    assert docs["mail.eml/Earlier thread.eml/seals.txt"].metadata == {
        "source": "mail.eml",
        "attachment_of": "mail.eml/Earlier thread.eml",
    }
    assert docs["mail.eml/report.docx"].metadata == {"source": "mail.eml", "attachment_of": "mail.eml"}


def test_eml_html_body_and_nesting_depth() -> None:
    msg = EmailMessage()
    msg["Subject"] = "Level 0"
    msg.set_content(
        "<h1>Status</h1><p>All green.</p><p style='display:none'>tracking pixel</p>", subtype="html"
    )
    inner = msg
    for level in range(1, 5):  # messages attached in messages, four deep
        nested = make_message(f"Level {level}", f"Body of level {level}.\n")
        inner.add_attachment(nested)
        inner = nested
    docs = parse_file("thread.eml", bytes(msg))
    top = docs[0]
    assert top.text.endswith("# Status\n\nAll green.") and "tracking pixel" not in top.text
    assert top.hidden_text_removed == 1
    assert [d.title for d in docs] == ["Level 0", "Level 1", "Level 2", "Level 3"]
    deepest = docs[-1]
    assert deepest.metadata["attachments_skipped"] == [
        {"name": "Level 4.eml", "type": "message/rfc822", "reason": "nested deeper than 3 levels"}
    ]


# -- long tables: cut by rows, the header with every piece ------------------------------------


def _table(rows: int) -> str:
    lines = ["| region | plan | monthly limit |", "| --- | --- | --- |"]
    lines += [f"| region{i} | plan{i % 3} | cap{i}units |" for i in range(rows)]
    return "\n".join(lines)


def test_a_long_table_is_cut_by_rows_each_piece_with_the_header() -> None:
    header = "| region | plan | monthly limit |\n| --- | --- | --- |"
    text = f"# Limits\n\nWhat each region may use.\n\n{_table(40)}\n\n# Support\n\nAsk support for more."
    size = 40
    chunks = make_chunks("limits.md", text, size=size, overlap=5)
    start, end = text.index("| region |"), text.index("cap39units |") + len("cap39units |")
    pieces = [c for c in chunks if c.start < end and c.end > start]
    assert len(pieces) > 3
    # the first piece holds the header itself, after what comes before the table
    assert pieces[0].text.startswith("# Limits\n\nWhat each region")
    assert f"\n\n{header}\n| region0 |" in pieces[0].text and "table_header" not in pieces[0].structure
    for piece in pieces[1:]:
        # a piece starts and ends at a row, and carries the header it does not repeat
        assert piece.text.startswith("| region") and piece.text.endswith("units |"), piece.text
        assert piece.structure["table_header"] == header
        assert piece.context == f"Limits\n{header}"
        assert len(regex_offsets(f"{header}\n{piece.text}")) <= size  # room was left for it
    # every row is in exactly one piece (no overlap inside a table), and nothing is lost
    rows = [
        line for c in pieces for line in c.text.split("\n") if line.startswith("| region") and "units" in line
    ]
    assert sorted(rows) == sorted(line for line in _table(40).split("\n")[2:])
    assert all(c.text == text[c.start : c.end] for c in chunks)
    [support] = [c for c in chunks if c not in pieces]
    assert support.text.startswith("# Support") and "table_header" not in support.structure


def test_table_header_without_a_rule_line_is_the_first_row() -> None:
    text = "| a | b |\n| 1 | 2 |\n| 3 | 4 |\n\nafter"
    assert table_header(text, text.index("| 3")) == "| a | b |"
    assert table_header(text, text.index("| 1")) == "| a | b |"
    assert table_header(text, 0) == "" and table_header(text, text.index("after")) == ""
    ruled = "| a | b |\n| --- | --- |\n| 1 | 2 |"
    assert table_header(ruled, ruled.index("| 1")) == "| a | b |\n| --- | --- |"


# -- limits and bad files -----------------------------------------------------------------------


def _with_member(data: bytes, member: str, content: bytes) -> bytes:
    """The zip ``data`` with ``member`` replaced by ``content``, compressed as hard as it goes."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.infolist():
            body = content if item.filename == member else src.read(item.filename)
            dst.writestr(item.filename, body, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return out.getvalue()


def test_zip_bombs_are_refused_from_the_directory() -> None:
    bomb = _with_member(make_xlsx(), "xl/worksheets/sheet1.xml", b"<worksheet" + b" " * (40 * MIB) + b"/>")
    assert len(bomb) < MIB
    with pytest.raises(ParseLimitError) as err:
        parse_file("bomb.xlsx", bomb)
    msg = err.value.message
    assert "'bomb.xlsx'" in msg and "compression ratio" in msg and "TANDEM_RETRIEVAL_PARSE_MAX_RATIO" in msg
    big = _with_member(make_pptx(), "ppt/slides/slide1.xml", b"<p:sld" + b" " * (2 * MIB) + b"/>")
    with pytest.raises(ParseLimitError) as err:
        parse_file("big.pptx", big, limits=ParseLimits(max_decompressed_bytes=MIB))
    assert "'big.pptx'" in err.value.message and "more than 1 MiB" in err.value.message


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("wide.xlsx", make_xlsx(rows=60)),
        ("wide.csv", make_csv([["x", "y"]] * 60)),
        ("wide.odt", make_odt(repeat_rows=100)),  # one row claimed a hundred times
    ],
)
def test_more_cells_than_the_limit_is_an_error_naming_the_file(name: str, data: bytes) -> None:
    with pytest.raises(ParseLimitError) as err:
        parse_file(name, data, limits=ParseLimits(max_cells=100))
    msg = err.value.message
    assert repr(name) in msg and "more than 100 table cells" in msg
    assert "TANDEM_RETRIEVAL_PARSE_MAX_CELLS" in msg
    assert parse_file(name, data, limits=ParseLimits(max_cells=1000))  # under the limit: read


def _zip(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for name, body in members.items():
            zf.writestr(name, body)
    return out.getvalue()


@pytest.mark.parametrize(
    ("name", "data", "kind"),
    [
        ("deck.pptx", b"PK\x03\x04 not really a zip", "PPTX"),
        ("deck.pptx", make_docx(), "PPTX"),  # a zip, but a Word file's
        ("book.xlsx", b"PK\x03\x04 not really a zip", "XLSX"),
        ("book.xlsx", _zip({"xl/workbook.xml": b"<unclosed"}), "XLSX"),
        ("text.odt", b"PK\x03\x04 not really a zip", "ODT"),
        ("text.odt", _zip({"content.xml": b"<office:document-content><unclosed"}), "ODT"),
        ("book.epub", b"PK\x03\x04 not really a zip", "EPUB"),
        ("book.epub", _zip({"mimetype": b"application/epub+zip"}), "EPUB"),  # no container
        ("data.csv", b'a,b\n"' + b"x" * 200_000 + b'",1\n', "CSV"),  # a field past the csv limit
        ("mail.eml", b"\x00\x01\x02 just bytes, no headers", "EML"),
    ],
)
def test_corrupt_files_are_400s_naming_the_file(name: str, data: bytes, kind: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_file(name, data)
    assert err.value.status_code == 400 and not isinstance(err.value, ParseLimitError)
    assert f"file {name!r} is not a readable {kind}" in err.value.message, err.value.message


# -- through the API ------------------------------------------------------------------------------


def test_xlsx_upload_finds_a_cell_with_its_column_names(client: httpx.Client) -> None:
    make(client, chunking={"size": 48, "overlap": 8})
    r = upload(client, "limits.xlsx", make_limits_xlsx(rows=80), metadata={"kind": "sheet"})
    assert r.status_code == 202, r.text  # parsed by the ingestion worker, in its sandbox
    job = run_queued_job(client, r)
    assert job["state"] == "succeeded" and job["file_errors"] == [], job
    header = "| region | plan | monthly limit |\n| --- | --- | --- |"
    [hit] = search(client, query="cap61units", mode="sparse", top_k=1)
    assert hit["document_id"] == "limits.xlsx" and hit["section"] == "Sheet: Limits"
    assert "| region61 | plan1 | cap61units |" in hit["text"]
    assert hit["table_header"] == header and not hit["text"].startswith("| region |")
    doc = client.get("/v1/collections/kb/documents/limits.xlsx").json()
    assert doc["text"].startswith(f"# Sheet: Limits\n\n{header}\n| region0 |")
    spans = doc["chunk_list"]
    assert len(spans) > 3 and spans[0].get("table_header") is None
    assert all(s["table_header"] == header and s["context"].endswith(header) for s in spans[1:])
    # a corrupt workbook beside a good file: a per-file error naming it
    r = client.post(
        "/v1/collections/kb/files",
        files=[("file", ("bad.xlsx", b"PK\x03\x04 junk")), ("file", ("fine.csv", make_csv([["a"], ["b"]])))],
    )
    job = run_queued_job(client, r)
    [err] = job["file_errors"]
    assert err["filename"] == "bad.xlsx" and "'bad.xlsx' is not a readable XLSX" in err["message"]


def test_eml_upload_makes_the_message_and_each_attachment_a_document(client: httpx.Client) -> None:
    make(client)
    r = upload(client, "mail.eml", make_eml(), metadata={"box": "support"})
    assert r.status_code == 202, r.text
    job = run_queued_job(client, r)
    assert job["state"] == "succeeded" and job["file_errors"] == [], job
    listed = client.get("/v1/collections/kb/documents", params={"limit": 20}).json()["documents"]
    assert sorted(d["id"] for d in listed) == sorted(EML_IDS)
    hits = search(client, query="valve pressure five bar", mode="sparse", top_k=1)
    assert hits[0]["document_id"] == "mail.eml/scan.pdf"
    assert hits[0]["metadata"] == {"source": "mail.eml", "attachment_of": "mail.eml", "box": "support"}
    assert hits[0]["pages"][0] == 1  # a PDF attachment's chunks keep their pages
    msg = client.get("/v1/collections/kb/documents/mail.eml").json()
    assert msg["title"] == "Pump report" and msg["metadata"]["attachments_failed"][0]["name"] == "broken.docx"


def test_csv_past_the_cell_setting_is_a_400_at_upload(
    client: httpx.Client, retrieval_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.retrieval.app import create_app
    from tests.helpers.servers import serve_app

    make(client)
    monkeypatch.setenv("TANDEM_RETRIEVAL_PARSE_MAX_CELLS", "50")
    with serve_app(create_app()) as url, httpx.Client(base_url=url, headers=dict(client.headers)) as c:
        r = c.post("/v1/collections/kb/files", files={"file": ("big.csv", make_csv([["x", "y"]] * 30))})
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "'big.csv'" in msg and "more than 50 table cells" in msg
        r = c.post("/v1/collections/kb/files", files={"file": ("small.csv", make_csv([["x", "y"]] * 20))})
        assert r.status_code == 201, r.text


def test_documents_of_a_file_keep_their_types() -> None:
    # parse_file's answer is what the sandbox child serialises: plain JSON values only
    import json
    from dataclasses import asdict

    for name, data in (("deck.pptx", make_pptx()), ("mail.eml", make_eml()), ("book.xlsx", make_xlsx())):
        docs = parse_file(name, data)
        assert all(isinstance(d, InputDocument) for d in docs)
        assert [InputDocument(**json.loads(json.dumps(asdict(d)))) for d in docs] == docs
