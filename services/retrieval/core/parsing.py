"""Uploaded files to documents, with real parsers (pypdfium2 and pdfplumber's table finder for
PDFs in reading order: core/pdf_layout.py; python-docx, BeautifulSoup,
markdown-it-py). Structure that chunking uses is kept as Markdown in the text: HTML
``<h1>``-``<h6>``, DOCX "Heading N" paragraphs, Markdown headings and PDF lines set in a
larger font all become ``#``-lines; code blocks become fenced blocks and tables ``| a | b |``
rows, in reading order, so the chunker keeps them whole; an HTML definition list becomes one
block per item, ``term: definition``. The text reads as people read it: a PDF's words
hyphenated at line ends are joined again, ligatures spelled out and soft hyphens dropped
(core/text_cleanup.py), HTML source line breaks are spaces. What the text cannot hold goes to
``InputDocument.structure`` (core/structure.py): the offset where each PDF page begins, the
offsets and box of each of its lines, and the HTML anchors of headings. Text a reader of the file cannot see (hidden HTML elements, text
in its background's colour, hidden Word runs, PDF text off the page or in the page's colour) is
left out unless the collection keeps it, and counted (core/hidden_text.py). Every problem is an
``InvalidRequest`` naming the file and what is wrong.
"""

from __future__ import annotations

import io
import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.common import jsonsafe
from services.common.chunking import body_line, body_text
from services.common.errors import InvalidRequest, UnsupportedMediaType
from services.retrieval.core import formats
from services.retrieval.core.hidden_text import docx_run_hidden, drop_hidden_html, drop_hidden_pdf_text
from services.retrieval.core.ocr import IMAGE_EXTENSIONS, OcrSettings
from services.retrieval.core.pdf_layout import PageLayout, TableBlock, TextLine, ocr_layout, page_layout
from services.retrieval.core.structure import sentinel, take_sentinels
from services.retrieval.core.tables import markdown_row, markdown_table
from services.retrieval.core.text_cleanup import fix_characters, join_hyphenated_lines

SUPPORTED: tuple[str, ...] = (".txt", ".md", ".markdown", ".html", ".htm", ".pdf", ".docx", ".jsonl")
# Decks, sheets, e-books and mail (core/formats_*.py).
SUPPORTED += (".pptx", ".xlsx", ".csv", ".tsv", ".odt", ".epub", ".eml")
# Formats whose parsers decompress, or do work out of proportion to the file's size: parsed
# only by the ingestion worker, in a child process with limits (services/retrieval/core/sandbox.py).
UNTRUSTED: tuple[str, ...] = (".pdf", ".docx", ".html", ".htm")
# Zip containers, and mail, whose attachments may be any of these.
UNTRUSTED += (".pptx", ".xlsx", ".odt", ".epub", ".eml")
# Images, read by OCR (core/ocr.py, core/image_files.py): decoders and models.
SUPPORTED += IMAGE_EXTENSIONS
UNTRUSTED += IMAGE_EXTENSIONS
MIB = 1024 * 1024


@dataclass(frozen=True)
class ParseLimits:
    """What one file may cost to parse (the settings TANDEM_RETRIEVAL_PARSE_*)."""

    max_decompressed_bytes: int = 256 * MIB
    max_ratio: float = 100.0
    max_pages: int = 2000
    timeout_s: float = 120.0
    max_text_bytes: int = 64 * MIB
    # Cells of all the tables and sheets of one file (XLSX, CSV, PPTX, ODT).
    max_cells: int = 2_000_000


class ParseLimitError(InvalidRequest):
    """A file breached one of the ParseLimits."""


class NoTextError(InvalidRequest):
    """A file that yields no text: ``pages_without_text`` names its pages (a PDF's or an
    image's), for the ingestion job to show."""

    def __init__(self, message: str, pages_without_text: list[int] | None = None) -> None:
        super().__init__(message, param="file", code="empty_file")
        self.pages_without_text = list(pages_without_text or [])


@dataclass
class InputDocument:
    """A document to ingest: what a parser makes of a file, or what a client sends as JSON."""

    id: str
    text: str
    title: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    # PDF pages and HTML anchors by offset in ``text`` (core/structure.py); {} for plain text.
    structure: dict[str, Any] = field(default_factory=dict)
    # Pieces of the file a reader cannot see that its parser left out (core/hidden_text.py).
    hidden_text_removed: int = 0


def extension_of(filename: str) -> str:
    dot = filename.rfind(".")
    return filename[dot:].lower() if dot > 0 else ""


def check_supported(filename: str) -> str:
    ext = extension_of(filename)
    if ext not in SUPPORTED:
        shown = ext or "(no extension)"
        raise UnsupportedMediaType(
            f"file {filename!r}: unsupported type {shown}; supported: {', '.join(SUPPORTED)}",
            param="file",
            code="unsupported_file_type",
        )
    return ext


def _decode(filename: str, data: bytes) -> str:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(
            f"file {filename!r} is not valid UTF-8 (invalid byte 0x{data[exc.start]:02x} at offset {exc.start})",
            param="file",
            code="invalid_utf8",
        ) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


_BLANKS = re.compile(r"\n{3,}")


def _tidy(text: str) -> str:
    lines = [ln.rstrip() for ln in text.split("\n")]
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()


def _table_row(cells: list[str]) -> str:
    return markdown_row(cells)


def markdown_to_text(source: str) -> str:
    """Markdown to plain text that keeps headings as ``#`` lines (for section-aware chunking),
    code blocks fenced and tables as ``| a | b |`` rows (kept whole by the chunker), and drops
    other markup (emphasis, links, images, HTML)."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark").enable("table")
    out: list[str] = []
    prefix = ""
    row: list[str] | None = None
    for tok in md.parse(source):
        if tok.type == "tr_open":
            row = []
        elif tok.type == "tr_close" and row is not None:
            out.append(_table_row(row))
            row = None
        elif tok.type == "table_close":
            out.append("")
        elif tok.type == "heading_open":
            prefix = "#" * int(tok.tag[1]) + " "
        elif tok.type == "inline":
            parts = []
            for child in tok.children or []:
                if child.type in ("text", "code_inline"):
                    parts.append(child.content)
                elif child.type in ("softbreak", "hardbreak"):
                    parts.append("\n")
                elif child.type == "image":
                    parts.append(child.content)
            if row is not None:
                row.append("".join(parts))
                continue
            out.append(prefix + "".join(parts))
            prefix = ""
        elif tok.type in ("fence", "code_block"):
            lang = tok.info.strip().split(" ")[0] if tok.type == "fence" else ""
            body = tok.content.rstrip("\n").replace("```", "` ` `")
            out.append(f"```{lang}\n{body}\n```")
        elif tok.type == "list_item_open":
            prefix = "- "
        elif tok.type == "paragraph_open" and prefix == "- ":
            continue
        if tok.type in ("paragraph_close", "heading_close", "fence", "code_block"):
            out.append("")
    return _tidy("\n".join(out))


_FENCED_RE = re.compile(r"(\n```\n.*?\n```\n)", re.DOTALL)


def _anchor_of(h: Any) -> str:
    """The id a link to heading ``h`` uses: its own, an ``<a id|name>`` in it, or that of the
    section it opens."""
    if h.get("id"):
        return str(h["id"])
    a = h.find("a", attrs={"id": True}) or h.find("a", attrs={"name": True})
    if a is not None:
        return str(a.get("id") or a.get("name"))
    parent = h.parent
    if parent is not None and parent.name in ("section", "article", "div") and parent.get("id"):
        first = parent.find(re.compile(r"^h[1-6]$"))
        if first is h:
            return str(parent["id"])
    return ""


def html_to_text(source: str) -> tuple[str, str]:
    """(text, title) of an HTML page: scripts and styles dropped, headings as ``#`` lines,
    ``<pre>`` as fenced blocks, tables as ``| a | b |`` rows, block elements on their own
    lines."""
    text, title, _anchors, _hidden = html_document(source)
    return text, title


# Breaks between blocks while an HTML page becomes text: a line break (``<br>``, table rows), a
# paragraph break, the start or end of a block that must begin its own line (code, a table, a
# heading), the boundary between two items of a definition list, the start of a definition
# list, and the boundary between two items of a list nested in a definition. All but the first
# are blank lines in the end, except inside a definition, where they are line breaks: an item
# stays one block of text (see ``_definition_text``). Control characters: the source's own are
# taken out first.
_LINE, _PARA, _HARD, _ITEM, _LIST, _SUB = "\x04", "\x01", "\x02", "\x03", "\x05", "\x06"
# A heading's "#" while the page becomes text: the page's own text that begins a line with "#"
# (a root prompt, a comment) is told from it, and kept from reading as a heading (``body_text``).
_HEAD = "\x07"
_MARKS = "\x00-\x07"  # the breaks, the heading mark, and structure.py's anchor sentinels
_SOURCE_MARKS = re.compile(f"[{_MARKS}]")
# White space as a browser collapses it (ASCII, and the no-break space this text never kept).
_SPACE = re.compile(r"[ \t\n\r\f\v\xa0]+")
_BREAK_RUN = re.compile(r" ?[\x01-\x06][ \x01-\x06]*")
# A definition up to this long (about a default chunk, 256 tokens) is one block with its term,
# nested lists included: the chunker cuts at blank lines, and such an item fits in a chunk. A
# longer one (a class with its methods, a struct with its members) is cut anyway: its nested
# items are blocks of their own, for chunks to be cut between them rather than inside them.
ITEM_BLOCK_CHARS = 1000
# Elements that start a new line where a browser draws them.
_BLOCKS = [
    *("p", "div", "li", "tr", "section", "article", "blockquote", "address", "aside", "details"),
    *("dialog", "fieldset", "figcaption", "figure", "footer", "form", "header", "hgroup", "hr"),
    *("main", "nav", "ol", "ul", "summary", "caption", "legend", "center"),
]


def html_document(source: str, keep_hidden_text: bool = False) -> tuple[str, str, list[list[Any]], int]:
    """(text, title, anchors, hidden) of an HTML page: ``html_to_text`` plus ``[[offset, id], ...]``
    of the headings that have an anchor, and the count of hidden pieces left out
    (``hidden_text.drop_hidden_html``; with ``keep_hidden_text`` only comments and templates).

    Text runs as a browser shows it: white space in the source (line breaks included) is one
    space, ``<br>`` a line break, block elements paragraphs. A definition list (``<dl>``:
    glossaries, parameter and option lists of Sphinx, DocBook and others) becomes one block per
    item, its terms and its definition on one line: ``term: definition`` (several ``<dt>`` of
    one ``<dd>`` joined by commas), the definition's further paragraphs, code, "Default: X"
    lines and short nested lists following on lines of their own, so that the chunker does not
    cut an item from its term."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(_SOURCE_MARKS.sub("", source), "html.parser")
    title = soup.title.get_text(" ", strip=True) if soup.title else ""
    hidden = drop_hidden_html(soup, keep=keep_hidden_text)  # before <style> goes: it reads the rules
    for tag in soup(["script", "style", "head"]):
        tag.decompose()
    for tag in soup.select("a.headerlink"):
        tag.decompose()  # Sphinx's permalink sign ("¶") after each heading and signature
    for pre in soup.find_all("pre"):
        code = pre.get_text().strip("\n").replace("```", "` ` `")
        pre.replace_with(f"{_HARD}\n```\n{code}\n```\n{_HARD}")
    _html_tables(soup)
    ids: list[str] = []
    for h in soup.find_all(re.compile(r"^h[1-6]$")):
        level = int(h.name[1])
        anchor = _anchor_of(h)
        mark = ""
        if anchor:
            mark = sentinel(len(ids))
            ids.append(anchor)
        h.replace_with(f"{_HARD}{mark}{_HEAD * level} {h.get_text(' ', strip=True)}{_HARD}")
    for br in soup.find_all("br"):
        br.replace_with(_LINE)
    for block in soup.find_all(_BLOCKS):
        block.insert_before(_PARA)
        block.insert_after(_PARA)
    for dl in reversed(soup.find_all("dl")):  # inner lists first: an outer item holds them
        sep = _SUB if dl.find_parent("dd") is not None else _ITEM
        dl.replace_with(_LIST + sep + sep.join(_definition_items(dl)) + sep)
    pieces = []
    for i, part in enumerate(_FENCED_RE.split("\n" + soup.get_text() + "\n")):
        if i % 2:
            pieces.append(part)  # a code block keeps its spacing
        else:
            part = _BREAK_RUN.sub(_blank_line, _SPACE.sub(" ", part))
            pieces.append("\n".join(ln.strip() for ln in part.split("\n")))
    text = body_text(_tidy("".join(pieces))).replace(_HEAD, "#")
    text, anchors = take_sentinels(fix_characters(text), ids)
    return text, title, anchors, hidden


def _blank_line(m: re.Match[str]) -> str:
    return "\n" if m.group(0).strip(" ") == _LINE else "\n\n"


def _html_tables(soup: Any) -> None:
    """Data tables as ``| a | b |`` rows. A table holding headings lays the page out (DocBook's
    FAQs: each section's heading and its questions are rows of one table): its cells are the
    page's flow, and its headings open sections."""
    headings = re.compile(r"^h[1-6]$")
    layout = [t for t in soup.find_all("table") if t.find(headings) is not None]
    for table in layout:
        for cell in table.find_all(["td", "th"]):
            cell.insert_after(" ")  # "1.1." and its question: two cells, one line
    for table in soup.find_all("table"):
        if any(table is t for t in layout):
            continue
        if any(parent not in layout for parent in table.find_parents("table")):
            continue  # a table nested in a data table is a cell's text
        rows = [
            _table_row([cell.get_text(" ", strip=True) for cell in tr.find_all(["th", "td"])])
            for tr in table.find_all("tr")
        ]
        table.replace_with(_HARD + _LINE.join(r for r in rows if r.strip("| ")) + _HARD)


def _dl_children(tag: Any) -> Any:
    """The ``<dt>``, ``<dd>`` and other content of a ``<dl>``, looking through the ``<div>`` that
    HTML allows around a group of them."""
    from bs4 import Tag

    for child in tag.children:
        if isinstance(child, Tag) and child.name == "div" and child.find(["dt", "dd"], recursive=False):
            yield from _dl_children(child)
        else:
            yield child


def _definition_items(dl: Any) -> list[str]:
    """The items of a ``<dl>``, each one block of text: ``term: definition`` when the ``<dd>``
    begins with text or another block; its terms and the ``<dd>`` apart when it begins with a
    nested definition list (a table of contents); a ``<dt>`` with no ``<dd>``, or the reverse,
    alone."""
    from bs4 import Tag

    items: list[str] = []
    terms: list[str] = []
    for child in _dl_children(dl):
        if isinstance(child, Tag) and child.name == "dt":
            term = _BREAK_RUN.sub(", ", _SPACE.sub(" ", child.get_text()))
            if term.strip(" ,"):
                terms.append(term.strip(" ,"))
            continue
        raw = child.get_text() if isinstance(child, Tag) else str(child)
        body = _definition_text(raw)
        if not body:
            continue
        lead = re.match(r"[\s\x01-\x06]*", raw)
        opening = lead.group(0) if lead else ""
        if not terms or _LIST in opening:
            items.extend(terms)
            items.append(body)
        else:
            term = ", ".join(terms)
            colon = "" if term[-1] in ":?!" else ":"
            # code begins on a line of its own already (its fence's), other blocks on the next
            gap = "" if body.startswith("\n") else _LINE if _HARD in opening else " "
            items.append(f"{term}{colon}{gap}{body}")
        terms = []
    items.extend(terms)
    return items


def _definition_text(raw: str) -> str:
    """A definition's text as lines of one block: its paragraph and block breaks are line
    breaks (``_LINE``), and so are the boundaries between the items of the lists nested in it
    while it is at most ``ITEM_BLOCK_CHARS`` long; a longer one's nested items are blocks
    (``_ITEM``). A code block in it keeps the new lines around its fences."""

    def line_break(m: re.Match[str]) -> str:
        run = m.group(0)
        return _ITEM if _ITEM in run else _SUB if _SUB in run else _LINE

    out: list[str] = []
    for i, part in enumerate(_FENCED_RE.split("\n" + raw + "\n")):
        if i % 2:
            out.append(part)
        else:
            out.append(_BREAK_RUN.sub(line_break, _SPACE.sub(" ", part)).strip(" " + _LINE + _SUB))
    text = "".join(out).strip(" " + _LINE + _ITEM + _LIST + _SUB)
    return text.replace(_SUB, _LINE if len(text) <= ITEM_BLOCK_CHARS else _ITEM)


def _limit(filename: str, what: str, setting: str) -> ParseLimitError:
    return ParseLimitError(
        f"file {filename!r}: {what} (limit set by TANDEM_RETRIEVAL_{setting})",
        param="file",
        code="parse_limit_exceeded",
    )


def pdf_to_text(filename: str, data: bytes, limits: ParseLimits = ParseLimits()) -> str:
    return pdf_document(filename, data, limits).text


@dataclass
class PdfText:
    """What ``pdf_document`` reads of a PDF."""

    text: str
    pages: list[list[int]]  # [[page, offset where its text begins], ...]
    hidden: int  # text runs left out as hidden
    lines: list[list[float]] = field(default_factory=list)  # [[start, end, page, x0, top, x1, bottom], ...]
    page_sizes: list[list[float]] = field(default_factory=list)  # [[page, width, height], ...]
    pages_without_text: list[int] = field(default_factory=list)
    page_errors: dict[int, str] = field(default_factory=dict)  # why OCR read nothing on a page

    def structure(self) -> dict[str, Any]:
        return {"pages": self.pages, "lines": self.lines, "page_sizes": self.page_sizes}


def pdf_document(
    filename: str,
    data: bytes,
    limits: ParseLimits = ParseLimits(),
    keep_hidden_text: bool = False,
    *,
    ocr: OcrSettings | None = None,
) -> PdfText:
    """A PDF's text in reading order (``pdf_layout``: lines, columns one after the other, ruled
    tables as Markdown tables with their header row), lines set in a larger font than the body
    as ``#`` headings, running heads and page numbers left out; ``pages``: where each page's text
    begins; ``lines``: each line's (or table row's) offsets in the text, page and box;
    ``hidden``: the text runs left out as hidden (``hidden_text.drop_hidden_pdf_text``; none
    with ``keep_hidden_text``). Words the typesetter hyphenated at a line end are whole again,
    except in code (monospaced type) and headings (``text_cleanup.join_hyphenated``).

    A page without a text layer is read by OCR (``ocr.ocr_pdf_pages``) when ``ocr`` is given;
    the pages that yield no text are ``pages_without_text``. An encrypted PDF that needs a
    password is an ``InvalidRequest`` (code ``encrypted_pdf``)."""
    layouts, hidden = _pdf_layouts(filename, data, limits, keep_hidden_text)
    errors: dict[int, str] = {}
    blank = [p.number for p in layouts if not p.has_text]
    if blank and ocr is not None:
        from services.retrieval.core.ocr import ocr_pdf_pages

        for read in ocr_pdf_pages(data, blank, ocr):
            lines = [(line.text, tuple(line.box)) for line in read.lines]
            layouts[read.page - 1] = ocr_layout(read.page, read.width, read.height, lines)  # type: ignore[arg-type]
            if read.error:
                errors[read.page] = read.error
    out = compose_pages(layouts)
    out.hidden = hidden
    out.pages_without_text = [p.number for p in layouts if not p.has_text]
    out.page_errors = {n: why for n, why in errors.items() if n in out.pages_without_text}
    return out


def _not_readable(filename: str, exc: Exception) -> InvalidRequest:
    return InvalidRequest(
        f"file {filename!r} is not a readable PDF: {type(exc).__name__}: {exc}",
        param="file",
        code="corrupt_file",
    )


def _encrypted(filename: str) -> InvalidRequest:
    return InvalidRequest(
        f"file {filename!r} is an encrypted PDF that needs a password to open; upload it decrypted",
        param="file",
        code="encrypted_pdf",
    )


def _pdf_layouts(
    filename: str, data: bytes, limits: ParseLimits, keep_hidden_text: bool
) -> tuple[list[PageLayout], int]:
    """Each page's reading order, and the count of hidden text runs left out. The hidden text
    is taken out of the pages by pypdf (``drop_hidden_pdf_text``); the pages it changed are
    read from a copy holding them as changed."""
    import pypdfium2 as pdfium

    try:
        doc = pdfium.PdfDocument(data)
    except pdfium.PdfiumError as exc:
        if "password" in str(exc).lower():
            raise _encrypted(filename) from None
        raise _not_readable(filename, exc) from None
    cleaned = None
    try:
        if len(doc) > limits.max_pages:
            raise _limit(filename, f"{len(doc)} pages, more than {limits.max_pages}", "PARSE_MAX_PAGES")
        reader = None if keep_hidden_text else _pypdf_reader(filename, data)
        hidden, changed = _drop_hidden(reader) if reader is not None else (0, [])
        if changed:
            cleaned = pdfium.PdfDocument(_pages_copy(reader, changed))
        copy_of = {n: i for i, n in enumerate(changed)}
        soft = _SoftHyphens(filename, data, reader)
        layouts: list[PageLayout] = []
        size = 0
        for n in range(len(doc)):
            page = cleaned[copy_of[n]] if cleaned is not None and n in copy_of else doc[n]
            try:
                layouts.append(page_layout(page, n + 1, soft_hyphens=soft.of(n)))
            finally:
                page.close()
            size += layouts[-1].chars
            if size > limits.max_text_bytes:
                raise _limit(
                    filename,
                    f"more than {limits.max_text_bytes // MIB} MiB of text",
                    "PARSE_MAX_DECOMPRESSED_MB",
                )
        return layouts, hidden
    except InvalidRequest:
        raise
    except Exception as exc:  # pdfium, pypdf and pdfplumber raise many kinds of errors on broken files
        raise _not_readable(filename, exc) from None
    finally:
        if cleaned is not None:
            cleaned.close()
        doc.close()


def _pypdf_reader(filename: str, data: bytes) -> Any:
    from pypdf import PdfReader
    from pypdf.errors import FileNotDecryptedError

    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        len(reader.pages)  # an encrypted file fails here (an empty user password opens by itself)
    except FileNotDecryptedError:
        raise _encrypted(filename) from None
    return reader


def _drop_hidden(reader: Any) -> tuple[int, list[int]]:
    """(hidden text runs taken out, the 0-based pages they were on)."""
    hidden = 0
    changed: list[int] = []
    for n, page in enumerate(reader.pages):
        removed = drop_hidden_pdf_text(page)
        if removed:
            hidden += removed
            changed.append(n)
    return hidden, changed


def _pages_copy(reader: Any, pages: list[int]) -> bytes:
    """A PDF of ``pages`` of ``reader`` as they are now (their hidden text taken out)."""
    from pypdf import PdfWriter

    writer = PdfWriter()
    for n in pages:
        writer.add_page(reader.pages[n])
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


class _SoftHyphens:
    """The words each page breaks at a line end with a soft hyphen (U+00AD), as pypdf reads
    them: pdfium shows every line-end hyphen alike. Looked up only for a page that has a hyphen
    at a line end, and read only where the page's fonts can write a soft hyphen."""

    def __init__(self, filename: str, data: bytes, reader: Any) -> None:
        self.filename, self.data, self.reader = filename, data, reader

    def of(self, n: int) -> Callable[[], set[str]]:
        return lambda: self.words(n)

    def words(self, n: int) -> set[str]:
        try:
            if self.reader is None:
                self.reader = _pypdf_reader(self.filename, self.data)
            page = self.reader.pages[n]
            if not _may_write_soft_hyphens(page):
                return set()
            text = page.extract_text() or ""
        except InvalidRequest:
            raise
        except Exception:  # pypdf cannot read what pdfium did: no soft hyphens known
            return set()
        ends = (re.search(r"(\w+)\u00ad\s*$", line) for line in text.split("\n"))
        return {m.group(1) for m in ends if m}


def _may_write_soft_hyphens(page: Any) -> bool:
    """Whether a pypdf page has a font that can write a soft hyphen: its ToUnicode map has
    U+00AD, or it is a simple font in WinAnsiEncoding (0xAD) and the page's content has 0xAD."""
    resources = page.get("/Resources")
    fonts = resources.get_object().get("/Font") if resources is not None else None
    win_ansi = False
    for ref in fonts.get_object().values() if fonts is not None else []:
        font = ref.get_object()
        unicode = font.get("/ToUnicode")
        if unicode is not None:
            if b"00ad" in unicode.get_object().get_data().lower():
                return True
        elif font.get("/Subtype") != "/Type0":
            win_ansi = win_ansi or _win_ansi_soft_hyphen(font.get("/Encoding"))
    if not win_ansi:
        return False
    contents = page.get_contents()
    body = contents.get_data() if contents is not None else b""
    return b"\xad" in body or b"\\255" in body


def _win_ansi_soft_hyphen(encoding: Any) -> bool:
    """Whether a simple font's ``/Encoding`` reads code 0xAD as WinAnsi's soft hyphen."""
    encoding = encoding.get_object() if encoding is not None else None
    if encoding == "/WinAnsiEncoding":
        return True
    if not hasattr(encoding, "get") or encoding.get("/BaseEncoding") != "/WinAnsiEncoding":
        return False
    code = -1
    for entry in encoding.get("/Differences") or []:  # [code /name /name code /name ...]
        if isinstance(entry, int):
            code = int(entry)
        else:
            if code == 0xAD:
                return False  # renamed
            code += 1
    return True


# A page number alone: "24", "ix".
_PAGE_NUMBER = re.compile(r"^\s*(?:\d{1,5}|[ivxlcdm]{1,7})\s*$", re.IGNORECASE)
# A running head or foot is on this many pages at least, its numbers aside.
RUNNING_MIN_PAGES = 3


def _running_lines(pages: list[list[str]]) -> list[set[int]]:
    """For each page (its lines), the lines that are running heads and feet: a first or last
    line that, its numbers aside, is the first (or last) line of ``RUNNING_MIN_PAGES`` pages or
    more ("Chapter 4: Function reference 14"), or a page number alone. Left in, such a line
    joins the sentence it breaks: "Chapter 4: Function reference 14 Returns: the new node ..."."""

    def key(line: str) -> str:
        return re.sub(r"\d+", "#", re.sub(r"\s+", " ", line.strip()))

    firsts = [key(ls[0]) for ls in pages if ls and ls[0].strip()]
    lasts = [key(ls[-1]) for ls in pages if ls and ls[-1].strip()]

    def running(line: str, ends: list[str]) -> bool:
        return bool(_PAGE_NUMBER.match(line)) or ends.count(key(line)) >= RUNNING_MIN_PAGES

    out: list[set[int]] = []
    for ls in pages:
        lo, hi = 0, len(ls)
        # a head line and a page number may both be there, in either order
        for _ in range(2):
            if hi - lo > 1 and running(ls[lo], firsts):
                lo += 1
            if hi - lo > 1 and running(ls[hi - 1], lasts):
                hi -= 1
        out.append(set(range(lo)) | set(range(hi, len(ls))))
    return out


def _without_running_heads(pages: list[str]) -> list[str]:
    """``pages`` (texts) without their running heads and feet (``_running_lines``)."""
    lines = [p.strip("\n").split("\n") for p in pages]
    drop = _running_lines(lines)
    return [
        "\n".join(ln for i, ln in enumerate(ls) if i not in gone)
        for ls, gone in zip(lines, drop, strict=True)
    ]


def _size_levels(layouts: list[PageLayout]) -> dict[float, int]:
    """Heading level of each font size larger than the body text's (the size most characters
    have): the largest is level 1, six levels at most."""
    weight: Counter[float] = Counter()
    for page in layouts:
        for item in page.items:
            if isinstance(item, TextLine) and item.size > 0:
                weight[item.size] += len(item.text)
    if not weight:
        return {}
    body = weight.most_common(1)[0][0]
    bigger = sorted((sz for sz in weight if sz >= body * 1.15), reverse=True)[:6]
    return {sz: i + 1 for i, sz in enumerate(bigger)}


@dataclass
class _Line:
    """A line of a page on its way into the text: its box (None for a table's ``| --- |`` line
    and for a blank line), heading level, and whether it is code; a blank line around a table
    is ``hard`` (it stays next to a heading)."""

    text: str
    box: tuple[float, float, float, float] | None = None
    level: int = 0
    mono: bool = False
    hard: bool = False
    mono_start: bool = False
    mono_end: bool = False


def _page_lines(page: PageLayout, levels: dict[float, int]) -> list[_Line]:
    """A page's items as lines: tables as Markdown tables between blank lines, a heading of two
    lines or more as one line, and no paragraph break next to a heading."""
    out: list[_Line] = []
    for item in page.items:
        if item is None:
            if out and out[-1].text and not out[-1].level:
                out.append(_Line(""))
            continue
        if isinstance(item, TableBlock):
            rows = markdown_table(item.rows).split("\n")
            boxes = [item.row_boxes[0], None, *item.row_boxes[1:]]
            out.append(_Line("", hard=True))
            if item.caption is not None:
                out.append(_Line(item.caption.text, item.caption.box))
            out += [_Line(r, b) for r, b in zip(rows, boxes, strict=False)]
            out.append(_Line("", hard=True))
            continue
        text = re.sub(r"\s+", " ", item.text.strip())
        level = levels.get(item.size, 0) if len(text) <= 200 and not text.startswith("#") else 0
        if level and out and not out[-1].text and not out[-1].hard:
            out.pop()  # a heading opens a section: no blank line before it
        prev = out[-1] if out else None
        if (
            level
            and prev is not None
            and prev.level == level
            and prev.box is not None
            and -1 <= item.box[1] - prev.box[3] <= 0.6 * item.size  # the heading's next line
        ):
            x0, top, x1, bottom = prev.box
            prev.text += " " + text
            prev.box = (min(x0, item.box[0]), top, max(x1, item.box[2]), max(bottom, item.box[3]))
            continue
        out.append(
            _Line(
                text if level else item.text,
                item.box,
                level,
                item.mono,
                False,
                item.mono_start,
                item.mono_end,
            )
        )
    return out


def _tidy_lines(lines: list[_Line]) -> list[_Line]:
    """``lines`` without blank lines at either end or after another."""
    out: list[_Line] = []
    for ln in lines:
        if ln.text.strip() or (out and out[-1].text.strip()):
            out.append(ln)
    while out and not out[-1].text.strip():
        out.pop()
    return out


def compose_pages(layouts: list[PageLayout]) -> PdfText:
    """The text of the pages' lines: running heads out, headings as ``#`` lines, characters
    fixed and hyphenated words joined; each page's start and each line's offsets and box."""
    levels = _size_levels(layouts)
    pages = [_tidy_lines(_page_lines(p, levels)) for p in layouts]
    gone = _running_lines([[ln.text for ln in ls if ln.text.strip()] for ls in pages])
    for n, lines in enumerate(pages):
        written = [ln for ln in lines if ln.text.strip()]
        dropped = {id(written[i]) for i in gone[n]}
        pages[n] = _tidy_lines([ln for ln in lines if id(ln) not in dropped])
    texts = [[fix_characters(ln.text, soft_hyphens=False) for ln in ls] for ls in pages]
    pairs = [list(zip(ts, ls, strict=True)) for ts, ls in zip(texts, pages, strict=True)]
    kept = [{t for t, ln in page if ln.level or ln.mono} for page in pairs]
    code_end = [{t for t, ln in page if ln.mono_end} for page in pairs]
    code_start = [{t for t, ln in page if ln.mono_start} for page in pairs]

    def keep(page: int, line: str, word: str) -> bool:
        """Headings and code keep their hyphens: a line of code, a line that ends in a word of
        code (the word with its hyphen) or begins with one (the rest of a word)."""
        ends = code_end if word[-1:] in "-\u2010\u00ad" else code_start
        return line in kept[page] or line in ends[page]

    joined, emptied = join_hyphenated_lines(texts, keep)
    parts: list[str] = []
    offsets: list[list[int]] = []
    boxes: list[list[float]] = []
    pos = 0
    for p, (layout, lines) in enumerate(zip(layouts, pages, strict=True)):
        body: list[str] = []
        placed: list[tuple[int, int, tuple[float, float, float, float]]] = []
        size = 0  # of "\n".join(body)
        for i, ln in enumerate(lines):
            text = "" if (p, i) in emptied else fix_characters(joined[p][i]).rstrip()
            if ln.level and text.strip():
                text = f"{'#' * ln.level} {text.strip()}"
            if not text.strip():
                if body and body[-1]:
                    body.append("")
                    size += 1
                continue
            if not body:
                text = text.lstrip()
            if not ln.level:
                text = body_line(text)
            size += 1 if body else 0
            if ln.box is not None:
                placed.append((size, size + len(text), ln.box))
            body.append(text)
            size += len(text)
        while body and not body[-1]:
            body.pop()
        page_text = "\n".join(body)
        if page_text and parts:
            pos += 2  # the blank line between pages
        # An empty page begins where the next page's text will (so it holds no text).
        offsets.append([layout.number, pos if page_text or not parts else pos + 2])
        if page_text:
            parts.append(page_text)
            boxes += [[pos + a, pos + b, layout.number, *(round(v, 2) for v in box)] for a, b, box in placed]
            pos += len(page_text)
    sizes: list[list[float]] = [[p.number, p.width, p.height] for p in layouts]
    return PdfText("\n\n".join(parts), offsets, 0, boxes, sizes)


def check_zip(filename: str, data: bytes, limits: ParseLimits, *, kind: str = "DOCX") -> None:
    """Refuse a zip bomb from its directory, before inflating anything. The declared sizes can
    be trusted: zipfile stops at the declared size and fails the CRC of a member that lies."""
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            members = zf.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise InvalidRequest(
            f"file {filename!r} is not a readable {kind}: {exc}", param="file", code="corrupt_file"
        ) from None
    total = sum(m.file_size for m in members)
    if total > limits.max_decompressed_bytes:
        raise _limit(
            filename,
            f"decompresses to {total} bytes, more than {limits.max_decompressed_bytes // MIB} MiB",
            "PARSE_MAX_DECOMPRESSED_MB",
        )
    for m in members:
        # Small members compress arbitrarily well (a run of spaces): only large ones count.
        if m.file_size > MIB and m.file_size / max(m.compress_size, 1) > limits.max_ratio:
            ratio = m.file_size / max(m.compress_size, 1)
            raise _limit(
                filename,
                f"member {m.filename!r} has a compression ratio of {ratio:.0f}:1, more than {limits.max_ratio:g}:1",
                "PARSE_MAX_RATIO",
            )


def docx_to_text(
    filename: str, data: bytes, limits: ParseLimits = ParseLimits(), keep_hidden_text: bool = False
) -> tuple[str, str, int]:
    """(text, title, hidden): ``hidden`` counts the hidden runs (``w:vanish``) left out; with
    ``keep_hidden_text`` they stay."""
    check_zip(filename, data, limits)
    try:
        return _docx_to_text(data, keep_hidden_text)
    except InvalidRequest:
        raise
    except Exception as exc:  # malformed XML (lxml), missing parts, bad relationships...
        raise InvalidRequest(
            f"file {filename!r} is not a readable DOCX: {type(exc).__name__}: {exc}",
            param="file",
            code="corrupt_file",
        ) from None


def _docx_to_text(data: bytes, keep_hidden_text: bool = False) -> tuple[str, str, int]:
    """Paragraphs and tables in the order of the document's body; "Heading N" and "Title"
    paragraphs as ``#`` lines, tables as Markdown tables (their first row the header)."""
    from docx import Document
    from docx.table import Table
    from docx.text.paragraph import Paragraph
    from docx.text.run import Run

    # Runs left out; a set, since a merged cell is in every row and column it spans.
    hidden: set[Any] = set()

    def text_of(para: Paragraph) -> str:
        if keep_hidden_text:
            return para.text
        out = []
        for item in para.iter_inner_content():
            for run in [item] if isinstance(item, Run) else item.runs:
                if not docx_run_hidden(run):
                    out.append(run.text)
                elif run.text.strip():
                    hidden.add(run._r)
        return "".join(out)

    doc = Document(io.BytesIO(data))
    lines: list[str] = []
    for el in doc.element.body.iterchildren():
        tag = el.tag.rsplit("}", 1)[-1]
        if tag == "tbl":
            rows = [
                ["\n".join(text_of(p) for p in cell.paragraphs) for cell in row.cells]
                for row in Table(el, doc).rows
            ]
            lines.append("\n" + markdown_table(rows) + "\n")
            continue
        if tag != "p":
            continue
        para = Paragraph(el, doc)
        style = (para.style.name if para.style is not None else "") or ""
        text = text_of(para).strip()
        if not text:
            continue
        m = re.match(r"Heading (\d)", style)
        if m:
            lines.append(f"\n{'#' * min(int(m.group(1)), 6)} {text}\n")
        elif style == "Title":
            lines.append(f"\n# {text}\n")
        else:
            lines.append(body_text(text) + "\n")
    title = (doc.core_properties.title or "").strip()
    return _tidy("\n".join(lines)), title, len(hidden)


def jsonl_documents(filename: str, text: str) -> list[InputDocument]:
    """One document per line: ``{"id", "text", "title"?, "metadata"?}`` (BEIR's ``_id`` also works)."""
    docs = []
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = jsonsafe.loads(line, where=f"file {filename!r} line {n}")
        except json.JSONDecodeError as exc:
            raise InvalidRequest(
                f"file {filename!r} line {n}: not JSON ({exc.msg})", param="file", code="invalid_jsonl"
            ) from None
        if not isinstance(obj, dict):
            raise InvalidRequest(f"file {filename!r} line {n}: expected a JSON object", param="file")
        doc_id = obj.get("id", obj.get("_id"))
        body = obj.get("text")
        if not isinstance(doc_id, str | int) or str(doc_id) == "":
            raise InvalidRequest(f"file {filename!r} line {n}: missing 'id'", param="file")
        if not isinstance(body, str) or not body.strip():
            raise InvalidRequest(f"file {filename!r} line {n}: missing or empty 'text'", param="file")
        meta = obj.get("metadata") or {}
        if not isinstance(meta, dict):
            raise InvalidRequest(f"file {filename!r} line {n}: 'metadata' must be an object", param="file")
        docs.append(InputDocument(str(doc_id), body, str(obj.get("title") or ""), meta))
    if not docs:
        raise InvalidRequest(f"file {filename!r} has no documents", param="file", code="empty_file")
    return docs


def parse_file(
    filename: str,
    data: bytes,
    *,
    doc_id: str | None = None,
    limits: ParseLimits = ParseLimits(),
    keep_hidden_text: bool = False,
    ocr: OcrSettings | None = None,
) -> list[InputDocument]:
    """Documents in an uploaded file (one, or one per line for .jsonl). Text a reader of a PDF,
    DOCX or HTML file cannot see is left out, and counted in ``hidden_text_removed``, unless
    ``keep_hidden_text``. PDF pages without a text layer are read by OCR with ``ocr``, and PNG,
    JPEG and TIFF files are (core/image_files.py; default ``OcrSettings()``); the pages that
    yield no text are the document's ``metadata["pages_without_text"]``, and why OCR read
    nothing on one (its time or pixel limit) ``metadata["page_errors"]``. A file with no text at
    all is a ``NoTextError`` naming those pages.

    The formats of ``UNTRUSTED`` are parsed this way only inside the sandbox's child process;
    an e-mail's attachments are parsed by this function too, in the same child
    (core/formats_mail.py)."""
    ext = check_supported(filename)
    if not data:
        raise InvalidRequest(f"file {filename!r} is empty", param="file", code="empty_file")
    title = ""
    structure: dict[str, Any] = {}
    metadata: dict[str, Any] = {"source": filename}
    hidden = 0
    if ext == ".jsonl":
        return jsonl_documents(filename, _decode(filename, data))
    if ext == ".eml":  # the message and its attachments, each parsed as a file of its own
        from services.retrieval.core.formats_mail import mail_documents

        def attachment(name: str, content: bytes, att_id: str) -> list[InputDocument]:
            return parse_file(
                name, content, doc_id=att_id, limits=limits, keep_hidden_text=keep_hidden_text, ocr=ocr
            )

        return mail_documents(
            filename, data, doc_id=doc_id or filename, parse=attachment, keep_hidden_text=keep_hidden_text
        )
    if ext in formats.EXTENSIONS:
        text, title, structure, hidden = formats.reader(ext)(filename, data, limits, keep_hidden_text)
    elif ext == ".pdf" or ext in IMAGE_EXTENSIONS:
        if ext == ".pdf":
            pdf = pdf_document(filename, data, limits, keep_hidden_text, ocr=ocr)
        else:  # read by OCR, page by page, as a scanned PDF is
            from services.retrieval.core.image_files import image_document

            pdf = image_document(filename, data, limits, ocr or OcrSettings())
        text, hidden, structure = pdf.text, pdf.hidden, pdf.structure()
        if pdf.pages_without_text:
            metadata["pages_without_text"] = pdf.pages_without_text
        if pdf.page_errors:  # why OCR read nothing there: its time or pixel limit, a bad frame
            metadata["page_errors"] = {str(n): why for n, why in sorted(pdf.page_errors.items())}
    elif ext == ".docx":
        text, title, hidden = docx_to_text(filename, data, limits, keep_hidden_text)
        text = fix_characters(text)
    elif ext in (".html", ".htm"):
        text, title, anchors, hidden = html_document(_decode(filename, data), keep_hidden_text)
        if anchors:
            structure["anchors"] = anchors
    elif ext in (".md", ".markdown"):
        text = fix_characters(markdown_to_text(_decode(filename, data)))
    else:
        text = fix_characters(_tidy(_decode(filename, data)))
    if not text.strip():
        why = f" a reader can see ({hidden} hidden pieces left out: see keep_hidden_text)" if hidden else ""
        blank = metadata.get("pages_without_text") or []
        if blank:
            why += f" (pages without text: {_page_list(blank)})"
        for n, reason in (metadata.get("page_errors") or {}).items():
            why += f"; page {n}: {reason}"
        raise NoTextError(f"file {filename!r} contains no extractable text{why}", blank)
    return [InputDocument(doc_id or filename, text, title or filename, metadata, structure, hidden)]


def _page_list(pages: list[int]) -> str:
    """``[1, 2, 3, 5]`` as "1-3, 5"."""
    runs: list[list[int]] = []
    for p in pages:
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
