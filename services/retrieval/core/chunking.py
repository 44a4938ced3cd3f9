"""The retrieval service's chunks of a document: the cutting rules are
``services/common/chunking.py`` (shared with the trainer, which cuts passages the same way);
here each chunk gets its id and record. Chunk ids hash the document id, the context, the
offsets and the text: re-ingesting the same document yields the same ids.
"""

from __future__ import annotations

import hashlib

from services.common.chunking import Offsets, chunk_text, regex_offsets, sections
from services.retrieval.core.store import ChunkRecord

# re-exported: what callers of this module (and its tests) have always imported from it
__all__ = ["Offsets", "chunk_id", "chunk_text", "make_chunks", "regex_offsets", "sections"]


def chunk_id(doc_id: str, context: str, start: int, end: int, text: str) -> str:
    h = hashlib.sha256()
    for part in (doc_id, context, str(start), str(end), text):
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
) -> list[ChunkRecord]:
    out = []
    for ord_, (start, end, headings) in enumerate(
        chunk_text(text, size=size, overlap=overlap, offsets=offsets)
    ):
        context = " > ".join(p for p in (title.strip(), *headings) if p)
        piece = text[start:end]
        out.append(
            ChunkRecord(chunk_id(doc_id, context, start, end, piece), ord_, start, end, piece, context)
        )
    return out
