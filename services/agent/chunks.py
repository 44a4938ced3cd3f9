"""Retrieved chunks and the citations that point at them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict


@dataclass
class Chunk:
    """One search hit of the retrieval service; ``start``/``end`` are offsets in its document."""

    chunk_id: str
    document_id: str
    text: str
    score: float = 0.0
    scores: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    start: int = 0
    end: int = 0
    title: str = ""
    # Filled by components after retrieval (relevance gate, highlighter).
    relevance: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_result(cls, item: dict[str, Any]) -> Chunk:
        metadata = item.get("metadata") or {}
        text = str(item.get("text") or "")
        start = int(item.get("start") or 0)
        end = item.get("end")
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
        out.update(self.extra)
        return out


# What a citation copies of its chunk.
_CITED_FIELDS = ("chunk_id", "document_id", "title", "text", "start", "end")


class Citation(BaseModel):
    """``[index]`` in an answer resolved to the chunk it names.

    ``kind`` is ``cited`` when the model wrote the marker, ``attributed`` when the
    server matched an uncited answer to the chunk it overlaps most (so readers and
    the evaluation can tell the two apart).
    """

    model_config = ConfigDict(frozen=True)

    index: int
    chunk_id: str
    document_id: str
    title: str
    text: str
    start: int
    end: int
    kind: str = "cited"

    @classmethod
    def of(cls, index: int, chunk: Chunk, kind: str = "cited") -> Citation:
        return cls(index=index, kind=kind, **{f: getattr(chunk, f) for f in _CITED_FIELDS})

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()
