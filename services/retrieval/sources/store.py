"""The sources a collection follows, and what each sync left, in ``<collection>/sources.sqlite3``.

``sources`` holds each source as added (type, URL, branch, path globs, interval), when its next
sync is due, the job running one (``running_job``) and the outcome of the last. ``source_files``
holds, per file a source gave, the sha256 of the content that was ingested and the ids of the
documents it became (``sha256``), and the content that last failed and why (``failed_sha256``,
``error``): a sync parses only files whose content hash differs from both.

Every change is one transaction with ``synchronous=FULL``: a source is on disk before its 201,
and a crash mid-sync leaves each file's row as of the last batch committed to the collection
(a file whose documents were written but whose row was not is parsed again next time; its
chunks, content-addressed, are not embedded again).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from services.common.errors import Conflict, NotFound
from services.retrieval.job_results import LastSyncRow

SourceType = Literal["git", "web", "folder"]
FILE_NAME = "sources.sqlite3"
# The ``kind`` of a sync's job (an io job like ingestion and reindex: ingest.run_leased runs it).
SYNC_KIND = "sync"
# The folder of a collection that holds each source's Git checkout (``<id>/git``).
CACHE_DIR = "sources"

SCHEMA = """
CREATE TABLE IF NOT EXISTS sources (
    id TEXT PRIMARY KEY,
    type TEXT NOT NULL,
    url TEXT NOT NULL,
    branch TEXT,
    paths TEXT NOT NULL,
    interval_minutes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    next_sync_at REAL,
    last_sync TEXT,
    running_job TEXT
);
CREATE TABLE IF NOT EXISTS source_files (
    source_id TEXT NOT NULL,
    path TEXT NOT NULL,
    sha256 TEXT,
    doc_ids TEXT NOT NULL DEFAULT '[]',
    failed_sha256 TEXT,
    error TEXT,
    PRIMARY KEY (source_id, path)
) WITHOUT ROWID;
"""


@dataclass
class Source:
    id: str
    type: SourceType
    url: str
    branch: str | None
    paths: list[str]
    interval_minutes: int
    created_at: float
    next_sync_at: float | None
    last_sync: LastSyncRow | None = None
    running_job: str | None = None


@dataclass
class FileState:
    """What the collection holds of one file of a source."""

    path: str
    sha256: str | None = None  # content ingested; None: never ingested
    doc_ids: list[str] = field(default_factory=list)
    failed_sha256: str | None = None  # content that last failed to parse, and why
    error: str | None = None


def source_not_found(source_id: str, collection: str) -> NotFound:
    return NotFound(
        f"source {source_id!r} not found in collection {collection!r}", param="id", code="source_not_found"
    )


def _row(r: sqlite3.Row) -> Source:
    return Source(
        id=r["id"],
        type=r["type"],
        url=r["url"],
        branch=r["branch"],
        paths=json.loads(r["paths"]),
        interval_minutes=int(r["interval_minutes"]),
        created_at=float(r["created_at"]),
        next_sync_at=r["next_sync_at"],
        last_sync=json.loads(r["last_sync"]) if r["last_sync"] else None,
        running_job=r["running_job"],
    )


class SourceStore:
    """One collection's sources. A connection per call: the API and the io worker (other
    processes) use the same file, and SQLite's locks keep them apart."""

    def __init__(self, root: Path, collection: str) -> None:
        self.path = root / FILE_NAME
        self.collection = collection

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            con.row_factory = sqlite3.Row
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA synchronous=FULL")
            con.executescript(SCHEMA)
            con.execute("BEGIN IMMEDIATE")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")
        finally:
            con.close()

    def exists(self) -> bool:
        return self.path.exists()

    # -- sources -----------------------------------------------------------------------------
    def add(self, source: Source, limit: int) -> None:
        with self._tx() as con:
            rows = [_row(r) for r in con.execute("SELECT * FROM sources")]
            if len(rows) >= limit:
                raise Conflict(
                    f"collection {self.collection!r} follows {len(rows)} sources, the most it may "
                    "(TANDEM_RETRIEVAL_SOURCE_MAX_PER_COLLECTION)",
                    param="name",
                    code="too_many_sources",
                )
            for other in rows:
                if (other.type, other.url, other.branch, other.paths) == (
                    source.type,
                    source.url,
                    source.branch,
                    source.paths,
                ):
                    raise Conflict(
                        f"collection {self.collection!r} already follows {source.url!r} as source "
                        f"{other.id!r}",
                        param="url",
                        code="source_exists",
                    )
            con.execute(
                "INSERT INTO sources (id, type, url, branch, paths, interval_minutes, created_at, next_sync_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    source.id,
                    source.type,
                    source.url,
                    source.branch,
                    json.dumps(source.paths),
                    source.interval_minutes,
                    source.created_at,
                    source.next_sync_at,
                ),
            )

    def all(self) -> list[Source]:
        if not self.exists():
            return []
        with self._tx() as con:
            return [_row(r) for r in con.execute("SELECT * FROM sources ORDER BY created_at, id")]

    def get(self, source_id: str) -> Source:
        if not self.exists():
            raise source_not_found(source_id, self.collection)
        with self._tx() as con:
            row = con.execute("SELECT * FROM sources WHERE id = ?", (source_id,)).fetchone()
        if row is None:
            raise source_not_found(source_id, self.collection)
        return _row(row)

    def delete(self, source_id: str, busy: Callable[[str], bool]) -> list[str]:
        """Forget the source and its files; returns the ids of the documents it gave. A source
        whose sync is running (``busy(job_id)``) is a 409: the sync would write after."""
        with self._tx() as con:
            row = con.execute("SELECT * FROM sources WHERE id = ?", (source_id,)).fetchone()
            if row is None:
                raise source_not_found(source_id, self.collection)
            running = row["running_job"]
            if running and busy(running):
                raise Conflict(
                    f"source {source_id!r} is syncing (job {running}); delete it after the job ends",
                    param="id",
                    code="source_syncing",
                )
            doc_ids = [
                d
                for (ids,) in con.execute(
                    "SELECT doc_ids FROM source_files WHERE source_id = ?", (source_id,)
                )
                for d in json.loads(ids)
            ]
            con.execute("DELETE FROM source_files WHERE source_id = ?", (source_id,))
            con.execute("DELETE FROM sources WHERE id = ?", (source_id,))
        return doc_ids

    def claim(self, source_id: str, job_id: str, busy: Callable[[str], bool]) -> str | None:
        """Make ``job_id`` the source's running sync, unless another one runs: then its id."""
        with self._tx() as con:
            row = con.execute("SELECT running_job FROM sources WHERE id = ?", (source_id,)).fetchone()
            if row is None:
                raise source_not_found(source_id, self.collection)
            running = row["running_job"]
            if running and running != job_id and busy(running):
                return str(running)
            con.execute("UPDATE sources SET running_job = ? WHERE id = ?", (job_id, source_id))
        return None

    def finish(self, source_id: str, job_id: str, last_sync: LastSyncRow, next_sync_at: float | None) -> None:
        """Record the outcome of the sync ``job_id`` and when the next one is due."""
        with self._tx() as con:
            con.execute(
                "UPDATE sources SET last_sync = ?, next_sync_at = ?,"
                " running_job = CASE WHEN running_job = ? THEN NULL ELSE running_job END WHERE id = ?",
                (json.dumps(last_sync), next_sync_at, job_id, source_id),
            )

    def due(self, now: float) -> list[Source]:
        """Sources whose next sync is due at ``now``."""
        if not self.exists():
            return []
        with self._tx() as con:
            rows = con.execute(
                "SELECT * FROM sources WHERE next_sync_at IS NOT NULL AND next_sync_at <= ? ORDER BY next_sync_at",
                (now,),
            )
            return [_row(r) for r in rows]

    # -- files -------------------------------------------------------------------------------
    def files(self, source_id: str) -> dict[str, FileState]:
        with self._tx() as con:
            rows = con.execute(
                "SELECT path, sha256, doc_ids, failed_sha256, error FROM source_files WHERE source_id = ?",
                (source_id,),
            )
            return {
                r["path"]: FileState(
                    r["path"], r["sha256"], json.loads(r["doc_ids"]), r["failed_sha256"], r["error"]
                )
                for r in rows
            }

    def put_files(self, source_id: str, states: Sequence[FileState]) -> None:
        with self._tx() as con:
            con.executemany(
                "INSERT OR REPLACE INTO source_files (source_id, path, sha256, doc_ids, failed_sha256, error)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (source_id, s.path, s.sha256, json.dumps(s.doc_ids), s.failed_sha256, s.error)
                    for s in states
                ],
            )

    def drop_files(self, source_id: str, paths: Sequence[str]) -> None:
        with self._tx() as con:
            con.executemany(
                "DELETE FROM source_files WHERE source_id = ? AND path = ?", [(source_id, p) for p in paths]
            )

    def counts(self, source_id: str) -> tuple[int, int]:
        """(files ingested, documents they became)."""
        with self._tx() as con:
            rows = con.execute(
                "SELECT doc_ids FROM source_files WHERE source_id = ? AND sha256 IS NOT NULL", (source_id,)
            ).fetchall()
        return len(rows), sum(len(json.loads(r["doc_ids"])) for r in rows)
