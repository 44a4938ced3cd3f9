"""What an io job (ingestion, reindex, sync) leaves in its ``result`` and returns to its task.

Each is stored as JSON in the job's Redis hash and read back by ``GET /jobs/{id}`` as the
``Job.result`` object; the keys here are that contract. ``"pages without text"`` (with spaces)
repeats ``pages_without_text`` under the name the job's readers are told to look for.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

from services.retrieval.gate import GateVerdict

PagesByDocument = dict[str, list[int]]  # document id (or a source's file path) -> page numbers

PagesWithoutText = TypedDict(
    "PagesWithoutText",
    {
        "pages_without_text": PagesByDocument,
        "pages without text": PagesByDocument,
        # document id -> {page number: why OCR read nothing there}
        "page_errors": dict[str, dict[str, str]],
    },
)


class IngestResult(PagesWithoutText):
    documents: int
    chunks_added: int
    chunks_removed: int
    chunks_unchanged: int
    files_failed: int
    hidden_text_removed: int  # what the parsers left out as unseen by a reader (core/hidden_text.py)


class ReindexVersions(TypedDict):
    embedder: str
    index_version: int
    previous_version: int | None
    chunks: int


class ReindexGated(ReindexVersions, GateVerdict):
    """A gated reindex's result: the versions and the gate's verdict."""


ReindexResult = ReindexVersions | ReindexGated


class SyncCounts(TypedDict):
    """A sync's files by what happened to them (also the result of a sync that failed midway)."""

    source_id: str
    added: int
    changed: int
    removed: int
    failed: int
    unchanged: int
    errors: list[dict[str, str]]  # {"path", "code", "message"} (sources/fetched.py's file_error)
    commit: NotRequired[str]  # a git source's commit synced (absent from a sync that failed)


_PagesBySourceFile = TypedDict("_PagesBySourceFile", {"pages without text": NotRequired[PagesByDocument]})


class SyncResult(SyncCounts, _PagesBySourceFile):
    files: int
    documents: int
    chunks_added: int
    chunks_removed: int
    chunks_unchanged: int
    hidden_text_removed: int


class LastSyncRow(TypedDict):
    """A source's ``last_sync`` as stored in its row (read back as ``protocol.LastSync``)."""

    job_id: str
    status: str
    started_at: float
    finished_at: float
    counts: dict[str, int]
    errors: list[dict[str, str]]
    error: str | None
    commit: NotRequired[str]


class JobFailed(TypedDict):
    error: str


class JobSkipped(TypedDict):
    skipped: str  # why the job was left alone (finished already, or held by another worker)


JobOutcome = IngestResult | ReindexResult | SyncResult | JobFailed | JobSkipped
