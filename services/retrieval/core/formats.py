"""The readers of the formats beyond text, Markdown, HTML, PDF and DOCX, by extension: each
in a module of its own (core/formats_*.py), imported when a file of its kind comes. A reader
takes ``(filename, data, limits, keep_hidden_text)`` and gives ``(text, title, structure,
hidden)``, as ``parse_file`` makes a document of; e-mail, which is several documents, is
``formats_mail.mail_documents``."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.retrieval.core.parsing import ParseLimits

Reader = Callable[[str, bytes, "ParseLimits", bool], tuple[str, str, dict[str, Any], int]]

# extension -> (module, function)
_READERS = {
    ".pptx": ("formats_slides", "pptx_document"),
    ".xlsx": ("formats_sheets", "xlsx_document"),
    ".csv": ("formats_sheets", "csv_document"),
    ".tsv": ("formats_sheets", "csv_document"),
    ".odt": ("formats_odt", "odt_document"),
    ".epub": ("formats_epub", "epub_document"),
}
EXTENSIONS = tuple(_READERS)


def reader(ext: str) -> Reader:
    module, function = _READERS[ext]
    found: Reader = getattr(import_module(f"services.retrieval.core.{module}"), function)
    return found
