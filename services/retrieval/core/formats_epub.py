"""E-books (.epub, read with EbookLib) as documents: the chapters in the order of the book's
spine, each XHTML file read as any HTML page is (``parsing.html_document``: headings, tables,
code, text a reader cannot see left out). A chapter that does not open with a heading of its
own gets its title from the book's table of contents (or its XHTML ``<title>``) as a ``#``
heading, so chunks never span two chapters and name the chapter they are in. The book's own
table of contents page is left out: it repeats the headings.
"""

from __future__ import annotations

import io
import posixpath
from typing import Any

from services.retrieval.core.format_errors import check_text_size, reading
from services.retrieval.core.parsing import ParseLimits, _limit, check_zip, html_document


def epub_document(
    filename: str, data: bytes, limits: ParseLimits, keep_hidden_text: bool = False
) -> tuple[str, str, dict[str, Any], int]:
    """(text, title, structure, hidden pieces) of an e-book."""
    import ebooklib
    from bs4 import UnicodeDammit
    from ebooklib import epub

    check_zip(filename, data, limits, kind="EPUB")
    parts: list[str] = []
    hidden = size = 0
    with reading(filename, "EPUB"):
        book = epub.read_epub(io.BytesIO(data), {"ignore_ncx": True})
        titles = book.get_metadata("DC", "title")
        title = str(titles[0][0]).strip() if titles else ""
        chapters = _toc_titles(book.toc)
        spine = [book.get_item_with_id(idref) for idref, _linear in book.spine]
        if len(spine) > limits.max_pages:
            raise _limit(filename, f"{len(spine)} chapters, more than {limits.max_pages}", "PARSE_MAX_PAGES")
        for item in spine:
            if item is None or item.get_type() != ebooklib.ITEM_DOCUMENT or isinstance(item, epub.EpubNav):
                continue
            source = UnicodeDammit(item.get_content(), ["utf-8"]).unicode_markup or ""
            text, page_title, _anchors, removed = html_document(source, keep_hidden_text)
            hidden += removed
            if not text.strip():
                continue  # a cover or an image alone
            heading = chapters.get(posixpath.normpath(item.get_name())) or page_title
            if heading and not text.startswith("#"):
                text = f"# {' '.join(heading.split())}\n\n{text}"
            parts.append(text)
            size += len(text)
            check_text_size(filename, size, limits)
    return "\n\n".join(parts), title, {}, hidden


def _toc_titles(toc: Any) -> dict[str, str]:
    """File name -> the title of the first table-of-contents entry that points at it."""
    out: dict[str, str] = {}

    def visit(entries: Any) -> None:
        for entry in entries:
            if isinstance(entry, tuple | list):  # (section, children)
                visit(entry[:1])
                visit(entry[1] if len(entry) > 1 else [])
                continue
            href = getattr(entry, "href", "") or ""
            name = posixpath.normpath(href.split("#", 1)[0]) if href else ""
            if name and getattr(entry, "title", "") and name not in out:
                out[name] = str(entry.title)

    visit(toc)
    return out
