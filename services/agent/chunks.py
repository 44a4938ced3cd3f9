"""Retrieved chunks and the citations that point at them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from services.agent.locate import cited_sentence, page_at
from services.common.jsonsafe import JsonObject


@dataclass
class Chunk:
    """One search hit of the retrieval service; ``start``/``end`` are offsets in its document."""

    chunk_id: str
    document_id: str
    text: str
    score: float = 0.0
    scores: dict[str, float] = field(default_factory=dict)
    metadata: JsonObject = field(default_factory=dict)  # the document's, as its owner gave it
    start: int = 0
    end: int = 0
    title: str = ""
    # Where the chunk is in its document (the retrieval hit's fields; empty when unknown):
    # heading path, PDF pages (1-based) with the offset each begins at, HTML anchor.
    section: str = ""
    pages: list[int] = field(default_factory=list)
    page_starts: list[int] = field(default_factory=list)
    anchor: str | None = None
    # PDF and image chunks: [start, end, page, x0, top, x1, bottom] per line, offsets into
    # ``text``; the page sizes [page, width, height] they are measured in.
    boxes: list[list[float]] = field(default_factory=list)
    page_sizes: list[list[float]] = field(default_factory=list)
    # A piece of a long table after its first: the table's header row and rule line, which
    # the piece's text does not repeat (its offsets stay the document's).
    table_header: str = ""
    # Filled by the relevance gate after retrieval.
    relevance: float = 0.0
    # With a search that asked for sentences: the cosine to the search's query of each candidate
    # answer sentence and of the heading path they are read under, by their text (the reader's
    # similarities, without embedding them again).
    query_cosines: dict[str, float] = field(default_factory=dict)
    cosines_of: str = ""  # the question they were scored against

    @classmethod
    def from_result(cls, item: JsonObject) -> Chunk:
        """A hit of retrieval's search answer (its JSON: retrieval owns the shape)."""
        metadata = item.get("metadata") or {}
        text = str(item.get("text") or "")
        start = chunk_start = int(item.get("start") or 0)
        end = item.get("end")
        if item.get("section_text") and item.get("section_text_start") is not None:
            # the enclosing section the search returned (section_tokens): what is read and cited
            text = str(item["section_text"])
            start = int(item["section_text_start"])
            end = start + len(text)
        title = item.get("title") or (metadata.get("title") if isinstance(metadata, dict) else None) or ""
        return cls(
            chunk_id=str(item.get("chunk_id") or item.get("id") or ""),
            document_id=str(item.get("document_id") or ""),
            text=text,
            score=float(item.get("score") or 0.0),
            scores={k: float(v) for k, v in (item.get("scores") or {}).items() if isinstance(v, int | float)},
            metadata=metadata if isinstance(metadata, dict) else {},
            start=start,
            end=int(end) if end is not None else start + len(text),
            title=str(title),
            section=str(item.get("section") or ""),
            pages=[int(p) for p in item.get("pages") or [] if isinstance(p, int)],
            page_starts=[int(p) for p in item.get("page_starts") or [] if isinstance(p, int)],
            anchor=str(item["anchor"]) if item.get("anchor") else None,
            # the hit's boxes count from the chunk's start; ``text`` may begin earlier (its section)
            boxes=_boxes(item.get("boxes"), chunk_start - start),
            page_sizes=[[float(v) for v in s[:3]] for s in item.get("page_sizes") or [] if _numbers(s, 3)],
            table_header=str(item.get("table_header") or ""),
            query_cosines=_query_cosines(item),
        )

    def to_result(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "chunk_id": self.chunk_id,
            "document_id": self.document_id,
            "title": self.title,
            "text": self.text,
            "score": self.score,
            "scores": self.scores,
            "metadata": self.metadata,
            "start": self.start,
            "end": self.end,
        }
        if self.section:
            out["section"] = self.section
        if self.pages:
            out["pages"] = self.pages
            out["page_starts"] = self.page_starts
        if self.anchor:
            out["anchor"] = self.anchor
        if self.boxes:
            out["boxes"] = self.boxes
            out["page_sizes"] = self.page_sizes
        return out


def _numbers(row: Any, n: int) -> bool:
    return (
        isinstance(row, list)
        and len(row) >= n
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in row[:n])
    )


def _boxes(rows: Any, shift: int) -> list[list[float]]:
    """Well-formed line boxes of a hit, their offsets moved by ``shift``."""
    if not isinstance(rows, list):
        return []
    return [[float(r[0] + shift), float(r[1] + shift), *map(float, r[2:7])] for r in rows if _numbers(r, 7)]


# What a citation copies of its chunk.
_CITED_FIELDS = ("chunk_id", "document_id", "title", "text", "start", "end")


class CitedSpan(BaseModel):
    """The cited sentence: ``text == document.text[start:end]``."""

    model_config = ConfigDict(frozen=True)

    start: int
    end: int
    text: str


class ChunkCitation(BaseModel):
    """``[index]`` of an answer and the chunk it names. A search's answer cites its results so
    (the OpenAI facade lists them numbered); a generated answer's markers are :class:`Citation`."""

    model_config = ConfigDict(frozen=True)

    index: int
    chunk_id: str
    document_id: str
    title: str
    text: str
    start: int
    end: int


class HitPassage(BaseModel):
    text: str = ""


class SearchHit(ChunkCitation):
    """A search pipeline's result as :meth:`Chunk.to_result` writes it, with the ``passage``
    the highlight node adds (services/agent/highlight.py), read back where an answer lists the
    results (the OpenAI facade), ``index`` its number there; the fields not named are ignored."""

    passage: HitPassage | None = None

    @classmethod
    def listed(cls, results: list[dict[str, Any]]) -> list[SearchHit]:
        """``results`` numbered from 1, in their order."""
        return [cls.model_validate({**r, "index": i}) for i, r in enumerate(results, 1)]

    def citation(self) -> ChunkCitation:
        return ChunkCitation.model_validate(self.model_dump(exclude={"passage"}))


class Citation(ChunkCitation):
    """``[index]`` in an answer resolved to the chunk it names.

    ``kind`` is ``cited`` when the model wrote the marker, ``attributed`` when the
    server matched an uncited answer to the chunk it overlaps most (so readers and
    the evaluation can tell the two apart).

    ``span`` is the sentence of the chunk that supports the claim (services/agent/locate.py),
    as offsets in the document's text; ``page`` the PDF page it is on (1-based), ``section``
    the heading path of HTML, Markdown and DOCX (and headed PDF) documents, ``anchor`` the HTML
    id of that section. Each is None where the source has none. ``boxes`` and ``page_sizes``
    (PDF and image sources) place each line of ``text`` on its page, so a viewer highlights
    the lines the span covers; they are left out where the source has none.
    """

    kind: str = "cited"
    page: int | None = Field(default=None, description="PDF page (1-based) of the cited sentence.")
    section: str | None = Field(default=None, description="Heading path of the cited chunk's section.")
    anchor: str | None = Field(default=None, description="HTML id of the cited section's heading.")
    span: CitedSpan | None = Field(
        default=None, description="The cited sentence's offsets in the document text."
    )
    # Absent (not null) for sources without boxes, so other citations keep their shape.
    boxes: list[list[float]] | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="PDF and image sources: each line of the cited text as [start, end, page, x0, "
        "top, x1, bottom], offsets into 'text', the box in page units from the page's top-left.",
    )
    page_sizes: list[list[float]] | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="[page, width, height] of the pages in 'boxes', in the same units.",
    )

    @classmethod
    def of(cls, index: int, chunk: Chunk, kind: str = "cited", claim: str | None = None) -> Citation:
        """The citation of ``chunk``; ``claim``: the answer's sentence it supports (picks ``span``)."""
        start, end = cited_sentence(chunk.text, chunk.start, claim)
        text = chunk.text[start - chunk.start : end - chunk.start]
        return cls(
            index=index,
            kind=kind,
            page=page_at(chunk.pages, chunk.page_starts, start),
            section=chunk.section or None,
            anchor=chunk.anchor,
            span=CitedSpan(start=start, end=end, text=text),
            boxes=chunk.boxes or None,
            page_sizes=chunk.page_sizes if chunk.boxes else None,
            **{f: getattr(chunk, f) for f in _CITED_FIELDS},
        )

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


def _query_cosines(item: JsonObject) -> dict[str, float]:
    """A hit's scored sentences and context (search ``sentences``) by their text."""
    out: dict[str, float] = {}
    for sentence in item.get("sentences") or []:
        if isinstance(sentence, dict) and isinstance(sentence.get("score"), int | float):
            out[str(sentence.get("text") or "")] = float(sentence["score"])
    if item.get("context") and isinstance(item.get("context_score"), int | float):
        out[str(item["context"])] = float(item["context_score"])
    return out
