"""The retrieval service's chunks of a document: the cutting rules are
``services/common/chunking.py`` (shared with the trainer, which cuts passages the same way);
here each chunk gets its id and record, and what it knows of its document's structure
(``structure.chunk_structure``: heading path, enclosing section, PDF pages, HTML anchor).
A chunk that starts inside a table, past its header, carries the header (``table_header``)
in its context, indexed with its text, and in its structure, shown with it.
Chunk ids hash the document id, the context, the offsets, the text and the chunk's pages, line
boxes and anchor (when it has any): re-ingesting the same document yields the same ids.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from services.common.chunking import (
    Offsets,
    chunk_spans,
    chunk_text,
    regex_offsets,
    sections,
    table_at,
    tables,
)
from services.retrieval.core.store import ChunkRecord
from services.retrieval.core.structure import chunk_structure

# re-exported: what callers of this module (and its tests) have always imported from it
__all__ = ["Offsets", "chunk_id", "chunk_spans", "chunk_text", "make_chunks", "regex_offsets", "sections"]


def chunk_id(doc_id: str, context: str, start: int, end: int, text: str, located: str = "") -> str:
    h = hashlib.sha256()
    # ``located`` (pages, boxes, anchor) only when there is one: plain chunks keep the ids they had.
    for part in (doc_id, context, str(start), str(end), text, *((located,) if located else ())):
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()[:32]


def make_chunks(
    doc_id: str,
    text: str,
    *,
    title: str = "",
    size: int,
    overlap: int,
    offsets: Offsets = regex_offsets,
    structure: dict[str, Any] | None = None,
) -> list[ChunkRecord]:
    out = []
    tabs = tables(text)
    tab_starts = [t.start for t in tabs]
    for ord_, (start, end, section) in enumerate(
        chunk_spans(text, size=size, overlap=overlap, offsets=offsets)
    ):
        context = " > ".join(p for p in (title.strip(), *section.headings) if p)
        piece = text[start:end]
        meta = chunk_structure(structure or {}, start, end, section)
        table = table_at(tabs, start, tab_starts)
        if table is not None:
            # the rows of a long table after its first piece: their column names go with them
            meta["table_header"] = table.header(text)
            context = f"{context}\n{meta['table_header']}" if context else meta["table_header"]
        located = {k: meta[k] for k in ("pages", "anchor", "boxes") if k in meta}
        cid = chunk_id(doc_id, context, start, end, piece, json.dumps(located) if located else "")
        out.append(ChunkRecord(cid, ord_, start, end, piece, context, meta))
    return out
