"""Uploaded files to documents, with real parsers (pypdf, python-docx, BeautifulSoup,
markdown-it-py). Structure that chunking uses is kept as Markdown in the text: HTML
``<h1>``-``<h6>``, DOCX "Heading N" paragraphs, Markdown headings and PDF lines set in a
larger font all become ``#``-lines; code blocks become fenced blocks and tables ``| a | b |``
rows, in reading order, so the chunker keeps them whole. What the text cannot hold goes to
``InputDocument.structure`` (core/structure.py): the offset where each PDF page begins and
the HTML anchors of headings. Every problem is an ``InvalidRequest`` naming the file and
what is wrong.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass, field
from typing import Any

from services.common import jsonsafe
from services.common.errors import InvalidRequest, UnsupportedMediaType
from services.retrieval.core.structure import sentinel, take_sentinels

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
    text, title, _anchors = html_document(source)
    return text, title


def html_document(source: str) -> tuple[str, str, list[list[Any]]]:
    """(text, title, anchors) of an HTML page: ``html_to_text`` plus ``[[offset, id], ...]`` of
    the headings that have an anchor."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(source, "html.parser")
    title = soup.title.get_text(" ", strip=True) if soup.title else ""
    for tag in soup(["script", "style", "noscript", "template", "head"]):
        tag.decompose()
    for pre in soup.find_all("pre"):
        code = pre.get_text().strip("\n").replace("```", "` ` `")
        pre.replace_with(f"\n\n```\n{code}\n```\n\n")
    headings = re.compile(r"^h[1-6]$")
    # A table holding headings lays the page out (DocBook's FAQs: each section's heading and
    # its questions are rows of one table): its cells are the page's flow, and its headings
    # open sections. Any other table is data, kept whole as rows.
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
        table.replace_with("\n\n" + "\n".join(r for r in rows if r.strip("| ")) + "\n\n")
    ids: list[str] = []
    for h in soup.find_all(headings):
        level = int(h.name[1])
        anchor = _anchor_of(h)
        mark = ""
        if anchor:
            mark = sentinel(len(ids))
            ids.append(anchor)
        h.replace_with(f"\n\n{mark}{'#' * level} {h.get_text(' ', strip=True)}\n\n")
    for br in soup.find_all("br"):
        br.replace_with("\n")
    for block in soup.find_all(["p", "div", "li", "tr", "section", "article", "blockquote", "dt", "dd"]):
        block.insert_before("\n\n")
        block.insert_after("\n\n")
    raw = soup.get_text()
    pieces = []
    for i, part in enumerate(_FENCED_RE.split("\n" + raw + "\n")):
        if i % 2:
            pieces.append(part)  # a code block keeps its spacing
        else:
            pieces.append("\n".join(re.sub(r"[ \t\xa0]+", " ", ln).strip() for ln in part.split("\n")))
    text, anchors = take_sentinels(_tidy("".join(pieces)), ids)
    return text, title, anchors


def _limit(filename: str, what: str, setting: str) -> ParseLimitError:
    return ParseLimitError(
        f"file {filename!r}: {what} (limit set by TANDEM_RETRIEVAL_{setting})",
        param="file",
        code="parse_limit_exceeded",
    )


def pdf_to_text(filename: str, data: bytes, limits: ParseLimits = ParseLimits()) -> str:
    return pdf_document(filename, data, limits)[0]


def pdf_document(
    filename: str, data: bytes, limits: ParseLimits = ParseLimits()
) -> tuple[str, list[list[int]]]:
    """(text, pages) of a PDF: the pages' text in order, lines set in a larger font than the
    body as ``#`` headings, and ``[[page, offset], ...]`` where each page's text begins."""
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
        size = 0

        def visit(text: str, cm: Any, tm: Any, _font: Any, font_size: Any) -> None:
            if text.strip():
                scale = abs(float(tm[3]) * float(cm[3])) or 1.0
                runs.append((text.strip(), round(float(font_size or 0) * scale, 1)))

        for page in reader.pages:
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
    pages = _without_running_heads(pages)
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
    return "\n\n".join(parts), offsets


# A page number alone: "24", "ix".
_PAGE_NUMBER = re.compile(r"^\s*(?:\d{1,5}|[ivxlcdm]{1,7})\s*$", re.IGNORECASE)
# A running head or foot is on this many pages at least, its numbers aside.
RUNNING_MIN_PAGES = 3


def _without_running_heads(pages: list[str]) -> list[str]:
    """``pages`` without their running heads and feet: a first or last line that, its numbers
    aside, is the first (or last) line of ``RUNNING_MIN_PAGES`` pages or more ("Chapter 4: Function
    reference 14"), or a page number alone. Left in, such a line joins the sentence it breaks:
    "Chapter 4: Function reference 14 Returns: ASN1_SUCCESS ..."."""

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
    return {re.sub(r"\s+", " ", text): rank[sz] for text, sz in runs if sz in rank and len(text) <= 200}


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


def docx_to_text(filename: str, data: bytes, limits: ParseLimits = ParseLimits()) -> tuple[str, str]:
    check_zip(filename, data, limits)
    try:
        return _docx_to_text(data)
    except InvalidRequest:
        raise
    except Exception as exc:  # malformed XML (lxml), missing parts, bad relationships...
        raise InvalidRequest(
            f"file {filename!r} is not a readable DOCX: {type(exc).__name__}: {exc}",
            param="file",
            code="corrupt_file",
        ) from None


def _docx_to_text(data: bytes) -> tuple[str, str]:
    """Paragraphs and tables in the order of the document's body; "Heading N" and "Title"
    paragraphs as ``#`` lines, tables as ``| a | b |`` rows."""
    from docx import Document
    from docx.table import Table
    from docx.text.paragraph import Paragraph

    doc = Document(io.BytesIO(data))
    lines: list[str] = []
    for el in doc.element.body.iterchildren():
        tag = el.tag.rsplit("}", 1)[-1]
        if tag == "tbl":
            rows = [_table_row([cell.text for cell in row.cells]) for row in Table(el, doc).rows]
            lines.append("\n" + "\n".join(rows) + "\n")
            continue
        if tag != "p":
            continue
        para = Paragraph(el, doc)
        style = (para.style.name if para.style is not None else "") or ""
        text = para.text.strip()
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
    return _tidy("\n".join(lines)), title


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
    filename: str, data: bytes, *, doc_id: str | None = None, limits: ParseLimits = ParseLimits()
) -> list[InputDocument]:
    """Documents in an uploaded file (one, or one per line for .jsonl).

    PDF, DOCX and HTML are parsed this way only inside the sandbox's child process."""
    ext = check_supported(filename)
    if not data:
        raise InvalidRequest(f"file {filename!r} is empty", param="file", code="empty_file")
    title = ""
    structure: dict[str, Any] = {}
    if ext == ".jsonl":
        return jsonl_documents(filename, _decode(filename, data))
    if ext == ".pdf":
        text, pages = pdf_document(filename, data, limits)
        structure["pages"] = pages
    elif ext == ".docx":
        text, title = docx_to_text(filename, data, limits)
    elif ext in (".html", ".htm"):
        text, title, anchors = html_document(_decode(filename, data))
        if anchors:
            structure["anchors"] = anchors
    elif ext in (".md", ".markdown"):
        text = markdown_to_text(_decode(filename, data))
    else:
        text = _tidy(_decode(filename, data))
    if not text.strip():
        raise InvalidRequest(
            f"file {filename!r} contains no extractable text", param="file", code="empty_file"
        )
    return [InputDocument(doc_id or filename, text, title or filename, {"source": filename}, structure)]
