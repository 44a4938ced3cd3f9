"""Uploaded files to documents, with real parsers (pypdf, python-docx, BeautifulSoup,
markdown-it-py). Structure that chunking uses is kept as Markdown in the text: HTML
``<h1>``-``<h6>``, DOCX "Heading N" paragraphs, Markdown headings and PDF lines set in a
larger font all become ``#``-lines; code blocks become fenced blocks and tables ``| a | b |``
rows, in reading order, so the chunker keeps them whole; an HTML definition list becomes one
block per item, ``term: definition``. The text reads as people read it: a PDF's words
hyphenated at line ends are joined again, ligatures spelled out and soft hyphens dropped
(core/text_cleanup.py), HTML source line breaks are spaces. What the text cannot hold goes to
``InputDocument.structure`` (core/structure.py): the offset where each PDF page begins and
the HTML anchors of headings. Text a reader of the file cannot see (hidden HTML elements, text
in its background's colour, hidden Word runs, PDF text off the page or in the page's colour) is
left out unless the collection keeps it, and counted (core/hidden_text.py). Every problem is an
``InvalidRequest`` naming the file and what is wrong.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass, field
from typing import Any

from services.common import jsonsafe
from services.common.errors import InvalidRequest, UnsupportedMediaType
from services.retrieval.core.hidden_text import docx_run_hidden, drop_hidden_html, drop_hidden_pdf_text
from services.retrieval.core.structure import sentinel, take_sentinels
from services.retrieval.core.text_cleanup import fix_characters, join_hyphenated

SUPPORTED = (".txt", ".md", ".markdown", ".html", ".htm", ".pdf", ".docx", ".jsonl")
# Formats whose parsers decompress, or do work out of proportion to the file's size: parsed
# only by the ingestion worker, in a child process with limits (services/retrieval/core/sandbox.py).
UNTRUSTED = (".pdf", ".docx", ".html", ".htm")
MIB = 1024 * 1024


@dataclass(frozen=True)
class ParseLimits:
    """What one file may cost to parse (the settings TANDEM_RETRIEVAL_PARSE_*)."""

    max_decompressed_bytes: int = 256 * MIB
    max_ratio: float = 100.0
    max_pages: int = 2000
    timeout_s: float = 120.0
    max_text_bytes: int = 64 * MIB


class ParseLimitError(InvalidRequest):
    """A file breached one of the ParseLimits."""


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
    return "| " + " | ".join(re.sub(r"\s+", " ", c).strip().replace("|", "\\|") for c in cells) + " |"


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
_MARKS = "\x00-\x06"  # the breaks, and structure.py's anchor sentinels
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
        h.replace_with(f"{_HARD}{mark}{'#' * level} {h.get_text(' ', strip=True)}{_HARD}")
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
    text, anchors = take_sentinels(fix_characters(_tidy("".join(pieces))), ids)
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
    return pdf_document(filename, data, limits)[0]


def pdf_document(
    filename: str, data: bytes, limits: ParseLimits = ParseLimits(), keep_hidden_text: bool = False
) -> tuple[str, list[list[int]], int]:
    """(text, pages, hidden) of a PDF: the pages' text in order, lines set in a larger font than
    the body as ``#`` headings, ``[[page, offset], ...]`` where each page's text begins, and the
    count of text runs left out as hidden (``hidden_text.drop_hidden_pdf_text``; none with
    ``keep_hidden_text``). Words the typesetter hyphenated at a line end are whole again, except
    in code (monospaced type) and headings (``text_cleanup.join_hyphenated``)."""
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError, PdfStreamError

    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        if len(reader.pages) > limits.max_pages:
            raise _limit(
                filename, f"{len(reader.pages)} pages, more than {limits.max_pages}", "PARSE_MAX_PAGES"
            )
        pages: list[str] = []
        runs: list[tuple[str, float]] = []  # (text, font size) of every text run
        code: list[set[str]] = []  # per page, the hyphenated words that end lines of code
        size = hidden = 0

        def visit(text: str, cm: Any, tm: Any, font: Any, font_size: Any) -> None:
            if text.strip():
                scale = abs(float(tm[3]) * float(cm[3])) or 1.0
                runs.append((text.strip(), round(float(font_size or 0) * scale, 1)))
                if _monospaced(font):
                    code[-1].update(_hyphen_ends(fix_characters(text, soft_hyphens=False)))

        for page in reader.pages:
            code.append(set())
            if not keep_hidden_text:
                hidden += drop_hidden_pdf_text(page)
            pages.append(page.extract_text(visitor_text=visit) or "")
            size += len(pages[-1])
            if size > limits.max_text_bytes:
                raise _limit(
                    filename,
                    f"more than {limits.max_text_bytes // MIB} MiB of text",
                    "PARSE_MAX_DECOMPRESSED_MB",
                )
    except ParseLimitError:
        raise
    except (PdfReadError, PdfStreamError, ValueError, KeyError, TypeError, AssertionError) as exc:
        raise InvalidRequest(
            f"file {filename!r} is not a readable PDF: {exc}", param="file", code="corrupt_file"
        ) from None
    except Exception as exc:  # pypdf raises many kinds of errors on broken files
        raise InvalidRequest(
            f"file {filename!r} is not a readable PDF: {type(exc).__name__}: {exc}",
            param="file",
            code="corrupt_file",
        ) from None
    levels = _heading_levels(runs)
    pages = _readable_pages(_without_running_heads(pages), levels, code)
    parts: list[str] = []
    offsets: list[list[int]] = []
    pos = 0
    for n, raw in enumerate(pages, start=1):
        body = _tidy("\n".join(_pdf_line(ln, levels) for ln in raw.split("\n")))
        if body and parts:
            pos += 2  # the blank line between pages
        # An empty page begins where the next page's text will (so it holds no text).
        offsets.append([n, pos if body or not parts else pos + 2])
        if body:
            parts.append(body)
            pos += len(body)
    return "\n\n".join(parts), offsets, hidden


# A page number alone: "24", "ix".
_PAGE_NUMBER = re.compile(r"^\s*(?:\d{1,5}|[ivxlcdm]{1,7})\s*$", re.IGNORECASE)
# A running head or foot is on this many pages at least, its numbers aside.
RUNNING_MIN_PAGES = 3


def _without_running_heads(pages: list[str]) -> list[str]:
    """``pages`` without their running heads and feet: a first or last line that, its numbers
    aside, is the first (or last) line of ``RUNNING_MIN_PAGES`` pages or more ("Chapter 4: Function
    reference 14"), or a page number alone. Left in, such a line joins the sentence it breaks:
    "Chapter 4: Function reference 14 Returns: the new node ..."."""

    def key(line: str) -> str:
        return re.sub(r"\d+", "#", re.sub(r"\s+", " ", line.strip()))

    lines = [p.strip("\n").split("\n") for p in pages]
    firsts = [key(ls[0]) for ls in lines if ls[0].strip()]
    lasts = [key(ls[-1]) for ls in lines if ls[-1].strip()]

    def running(line: str, ends: list[str]) -> bool:
        return bool(_PAGE_NUMBER.match(line)) or ends.count(key(line)) >= RUNNING_MIN_PAGES

    out: list[str] = []
    for ls in lines:
        # a head line and a page number may both be there, in either order
        for _ in range(2):
            if len(ls) > 1 and running(ls[0], firsts):
                ls = ls[1:]
            if len(ls) > 1 and running(ls[-1], lasts):
                ls = ls[:-1]
        out.append("\n".join(ls))
    return out


# Font names of monospaced (code) type: Courier, *Mono, TeX's typewriter fonts (cmtt10, cmsltt10,
# sftt1000, ectt1000, txtt, lmmono10), ...
_MONO_FONT = re.compile(
    r"mono|courier|typewriter|consol|menlo|inconsolata|fixed|(?:^|[+/])(?:cm|cmsl|cmit|sf|sfsl|lm|ec|tc|tx)?tt\d",
    re.I,
)
_FIXED_PITCH = 1  # the FixedPitch bit of a PDF font descriptor's /Flags


def _monospaced(font: Any) -> bool:
    """Whether a text run's font (a PDF font dictionary) is a monospaced one: code."""
    try:
        if font is None:
            return False
        if _MONO_FONT.search(str(font.get("/BaseFont", ""))):
            return True
        descriptor = font.get("/FontDescriptor")
        flags = descriptor.get_object().get("/Flags", 0) if descriptor is not None else 0
        return bool(int(flags) & _FIXED_PITCH)
    except Exception:  # a broken font dictionary: read as text
        return False


def _hyphen_ends(text: str) -> set[str]:
    """The words, hyphen included, that lines of a code run end in: ``join_hyphenated`` never
    joins them to the next line."""
    ends = (re.search(r"(\w+(?:[-\u2010]\w+)*[-\u2010\u00ad])\s*$", line) for line in text.split("\n"))
    return {m.group(1) for m in ends if m}


def _readable_pages(pages: list[str], levels: dict[str, int], code: list[set[str]]) -> list[str]:
    """Pages with ligatures and soft hyphens fixed and words hyphenated at line ends joined
    (``text_cleanup``); headings and code keep their hyphens."""

    def keep(page: int, line: str, word: str) -> bool:
        return word in code[page] or re.sub(r"\s+", " ", line.strip()) in levels

    pages = [fix_characters(p, soft_hyphens=False) for p in pages]
    return [fix_characters(p) for p in join_hyphenated(pages, keep)]


def _heading_levels(runs: list[tuple[str, float]]) -> dict[str, int]:
    """Heading level of the text of each run set larger than the body text (the size most
    characters have): the largest size is level 1."""
    if not runs:
        return {}
    weight: dict[float, int] = {}
    for text, sz in runs:
        weight[sz] = weight.get(sz, 0) + len(text)
    body = max(weight, key=lambda k: weight[k])
    bigger = sorted({sz for _, sz in runs if sz >= body * 1.15}, reverse=True)[:6]
    rank = {sz: i + 1 for i, sz in enumerate(bigger)}
    return {
        re.sub(r"\s+", " ", fix_characters(text)): rank[sz]
        for text, sz in runs
        if sz in rank and len(text) <= 200
    }


def _pdf_line(line: str, levels: dict[str, int]) -> str:
    key = re.sub(r"\s+", " ", line.strip())
    level = levels.get(key)
    if level and not key.startswith("#"):
        return f"{'#' * level} {key}"
    return line


def check_zip(filename: str, data: bytes, limits: ParseLimits) -> None:
    """Refuse a zip bomb from its directory, before inflating anything. The declared sizes can
    be trusted: zipfile stops at the declared size and fails the CRC of a member that lies."""
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            members = zf.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise InvalidRequest(
            f"file {filename!r} is not a readable DOCX: {exc}", param="file", code="corrupt_file"
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
    paragraphs as ``#`` lines, tables as ``| a | b |`` rows."""
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
                _table_row(["\n".join(text_of(p) for p in cell.paragraphs) for cell in row.cells])
                for row in Table(el, doc).rows
            ]
            lines.append("\n" + "\n".join(rows) + "\n")
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
            lines.append(text + "\n")
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
) -> list[InputDocument]:
    """Documents in an uploaded file (one, or one per line for .jsonl). Text a reader of a PDF,
    DOCX or HTML file cannot see is left out, and counted in ``hidden_text_removed``, unless
    ``keep_hidden_text``.

    PDF, DOCX and HTML are parsed this way only inside the sandbox's child process."""
    ext = check_supported(filename)
    if not data:
        raise InvalidRequest(f"file {filename!r} is empty", param="file", code="empty_file")
    title = ""
    structure: dict[str, Any] = {}
    hidden = 0
    if ext == ".jsonl":
        return jsonl_documents(filename, _decode(filename, data))
    if ext == ".pdf":
        text, pages, hidden = pdf_document(filename, data, limits, keep_hidden_text)
        structure["pages"] = pages
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
        raise InvalidRequest(
            f"file {filename!r} contains no extractable text{why}", param="file", code="empty_file"
        )
    return [
        InputDocument(doc_id or filename, text, title or filename, {"source": filename}, structure, hidden)
    ]
