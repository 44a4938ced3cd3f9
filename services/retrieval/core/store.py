"""Chunk text, metadata and embeddings of one collection in SQLite, plus the operation log.

SQLite is the source of truth and the write-ahead log of the indexes: every
change of a collection is one transaction that writes the documents, their
chunks (with embeddings) and one row per chunk added or removed in ``ops``.
A document is acknowledged only after that transaction commits
(``synchronous=FULL``), so a ``kill -9`` cannot lose it, and a crash mid-way
leaves no part of it. The in-memory FAISS and BM25 indexes are derived state:
each process replays ``ops`` past the sequence number of the last index
checkpoint to catch up (see ``collection.py``).

Chunk ``vid`` (an ``AUTOINCREMENT`` integer, never reused) is the id the
vector and sparse indexes know a chunk by.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from services.common.errors import InvalidRequest
from services.retrieval.core.filters import Filter, to_sql
from services.retrieval.protocol import ChunkSpan, Document

SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (
    doc_id TEXT PRIMARY KEY,
    title TEXT NOT NULL DEFAULT '',
    text TEXT NOT NULL,
    metadata TEXT NOT NULL DEFAULT '{}',
    content_hash TEXT NOT NULL,
    n_chunks INTEGER NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS chunks (
    vid INTEGER PRIMARY KEY AUTOINCREMENT,
    chunk_id TEXT NOT NULL UNIQUE,
    doc_id TEXT NOT NULL,
    ord INTEGER NOT NULL,
    start INTEGER NOT NULL,
    "end" INTEGER NOT NULL,
    text TEXT NOT NULL,
    context TEXT NOT NULL DEFAULT '',
    embedding BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS chunks_doc ON chunks(doc_id);
CREATE TABLE IF NOT EXISTS ops (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL CHECK (kind IN ('add', 'del')),
    vid INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass(frozen=True)
class ChunkRecord:
    """A chunk ready to store: ``text == document.text[start:end]``; ``context`` (title and
    section headings) is indexed with it but is not part of the text."""

    chunk_id: str
    ord: int
    start: int
    end: int
    text: str
    context: str

    @property
    def index_text(self) -> str:
        return f"{self.context}\n{self.text}" if self.context else self.text


@dataclass
class DocumentRecord:
    doc_id: str
    text: str
    title: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    content_hash: str = ""
    chunks: list[ChunkRecord] = field(default_factory=list)


@dataclass(frozen=True)
class StoredChunk:
    vid: int
    chunk_id: str
    doc_id: str
    start: int
    end: int
    text: str
    metadata: dict[str, Any]
    title: str


@dataclass(frozen=True)
class LoggedOp:
    """One replayed operation; for ``add`` the chunk's embedding and index text (``None`` when
    the chunk was removed again later, which replay treats as a no-op)."""

    seq: int
    kind: str
    vid: int
    embedding: np.ndarray | None
    index_text: str | None


@dataclass(frozen=True)
class WriteResult:
    added: int
    removed: int
    unchanged: int
    seq: int


class MissingEmbeddings(Exception):
    """Raised inside a write when chunks that were expected to exist are gone (another writer
    replaced them meanwhile); the caller embeds these and retries."""

    def __init__(self, chunk_ids: set[str]) -> None:
        super().__init__(f"{len(chunk_ids)} chunk(s) need embeddings")
        self.chunk_ids = chunk_ids


@dataclass(frozen=True)
class SnapshotRow:
    vid: int
    embedding: np.ndarray
    index_text: str


@dataclass(frozen=True)
class Snapshot:
    """Every stored chunk (in vid order) and the log position they reflect: the input of a
    full index rebuild."""

    seq: int
    rows: list[SnapshotRow]


class ChunkStore(Protocol):
    """Documents and their chunks (with embeddings): what every backend stores. ``write``
    replaces documents by id; chunks keep their content-derived ids, so an unchanged chunk is
    neither re-embedded nor rewritten."""

    def existing_chunk_ids(self, chunk_ids: Iterable[str]) -> set[str]: ...

    def write(self, docs: Sequence[DocumentRecord], embeddings: dict[str, np.ndarray]) -> WriteResult:
        """Raises ``MissingEmbeddings`` (and writes nothing) when a chunk not stored yet has no
        embedding in ``embeddings``."""
        ...

    def delete_document(self, doc_id: str) -> bool: ...

    def get_document(self, doc_id: str) -> Document | None: ...

    def list_documents(self, limit: int, offset: int) -> tuple[list[Document], int]:
        """A page of documents ordered by id (without text), and the total."""
        ...

    def counts(self) -> tuple[int, int]:
        """(documents, chunks)."""
        ...

    def close(self) -> None: ...


class DocumentStore(ChunkStore, Protocol):
    """The embedded backend's store: a ``ChunkStore`` that is also the op log the in-process
    indexes replay. Metadata filters arrive parsed (``filters.Filter``); the store compiles
    them to its own query language."""

    def data_version(self) -> int:
        """A number that changes whenever another connection (thread or process) commits."""
        ...

    def snapshot(self) -> Snapshot: ...

    def chunks_by_vid(self, vids: Sequence[int]) -> dict[int, StoredChunk]: ...

    def ops_after(self, seq: int, limit: int = 4096) -> list[LoggedOp]: ...

    def last_seq(self) -> int: ...

    def vids_matching(self, where: Filter) -> np.ndarray:
        """vids of the chunks whose document's metadata matches ``where``."""
        ...


class SQLiteDocumentStore:
    """``DocumentStore`` over one SQLite file in WAL mode. Safe for threads (one lock per
    connection) and for several processes (SQLite's own locking with a busy timeout)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(str(path), timeout=60.0, isolation_level=None, check_same_thread=False)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is on disk before the client hears "ok" (survives power loss, not only kill -9).
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=OFF")
        self._conn.executescript(SCHEMA)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """An IMMEDIATE transaction: takes SQLite's write lock up front so concurrent writers
        (threads here, or the ingestion worker process) queue instead of failing mid-way."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            else:
                self._conn.execute("COMMIT")

    def data_version(self) -> int:
        """Changes whenever another connection (thread or process) commits: a cheap staleness check."""
        with self._lock:
            return int(self._conn.execute("PRAGMA data_version").fetchone()[0])

    def existing_chunk_ids(self, chunk_ids: Iterable[str]) -> set[str]:
        ids = list(chunk_ids)
        found: set[str] = set()
        with self._lock:
            for i in range(0, len(ids), 500):
                part = ids[i : i + 500]
                rows = self._conn.execute(
                    f"SELECT chunk_id FROM chunks WHERE chunk_id IN ({','.join('?' * len(part))})", part
                ).fetchall()
                found.update(r[0] for r in rows)
        return found

    def write(self, docs: Sequence[DocumentRecord], embeddings: dict[str, np.ndarray]) -> WriteResult:
        """Insert or replace ``docs`` in one transaction. Chunks whose content-derived id already
        exists are kept as they are (re-ingesting the same text changes nothing); chunks no
        longer produced are removed. ``embeddings`` must cover every chunk not yet stored."""
        added = removed = unchanged = 0
        now = time.time()
        with self._tx() as c:
            missing: set[str] = set()
            for doc in docs:
                rows = c.execute("SELECT vid, chunk_id FROM chunks WHERE doc_id=?", (doc.doc_id,)).fetchall()
                old = {r["chunk_id"]: int(r["vid"]) for r in rows}
                new_ids = {ch.chunk_id for ch in doc.chunks}
                for ch in doc.chunks:
                    if ch.chunk_id not in old and ch.chunk_id not in embeddings:
                        missing.add(ch.chunk_id)
                if missing:
                    continue
                for chunk_id, vid in old.items():
                    if chunk_id not in new_ids:
                        c.execute("DELETE FROM chunks WHERE vid=?", (vid,))
                        c.execute("INSERT INTO ops(kind, vid) VALUES ('del', ?)", (vid,))
                        removed += 1
                for ch in doc.chunks:
                    if ch.chunk_id in old:
                        unchanged += 1
                        continue
                    vec = np.ascontiguousarray(embeddings[ch.chunk_id], dtype=np.float32)
                    # A chunk id is unique per collection: the same content under another
                    # document id hashes differently (the id is part of the hash).
                    cur = c.execute(
                        'INSERT INTO chunks(chunk_id, doc_id, ord, start, "end", text, context, embedding)'
                        " VALUES (?,?,?,?,?,?,?,?)",
                        (
                            ch.chunk_id,
                            doc.doc_id,
                            ch.ord,
                            ch.start,
                            ch.end,
                            ch.text,
                            ch.context,
                            vec.tobytes(),
                        ),
                    )
                    c.execute("INSERT INTO ops(kind, vid) VALUES ('add', ?)", (cur.lastrowid,))
                    added += 1
                c.execute(
                    "INSERT INTO documents(doc_id, title, text, metadata, content_hash, n_chunks, created_at,"
                    " updated_at) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(doc_id) DO UPDATE SET title=excluded.title,"
                    " text=excluded.text, metadata=excluded.metadata, content_hash=excluded.content_hash,"
                    " n_chunks=excluded.n_chunks, updated_at=excluded.updated_at",
                    (
                        doc.doc_id,
                        doc.title,
                        doc.text,
                        json.dumps(doc.metadata, ensure_ascii=False, sort_keys=True),
                        doc.content_hash,
                        len(doc.chunks),
                        now,
                        now,
                    ),
                )
            if missing:
                raise MissingEmbeddings(missing)
            seq = int(c.execute("SELECT COALESCE(MAX(seq), 0) FROM ops").fetchone()[0])
        return WriteResult(added, removed, unchanged, seq)

    def delete_document(self, doc_id: str) -> bool:
        with self._tx() as c:
            found = c.execute("SELECT 1 FROM documents WHERE doc_id=?", (doc_id,)).fetchone()
            if not found:
                return False
            for r in c.execute("SELECT vid FROM chunks WHERE doc_id=?", (doc_id,)).fetchall():
                c.execute("INSERT INTO ops(kind, vid) VALUES ('del', ?)", (int(r[0]),))
            c.execute("DELETE FROM chunks WHERE doc_id=?", (doc_id,))
            c.execute("DELETE FROM documents WHERE doc_id=?", (doc_id,))
        return True

    @staticmethod
    def _doc(r: sqlite3.Row, with_text: bool) -> Document:
        return Document(
            id=r["doc_id"],
            title=r["title"],
            metadata=json.loads(r["metadata"]),
            chunks=int(r["n_chunks"]),
            created_at=float(r["created_at"]),
            updated_at=float(r["updated_at"]),
            text=r["text"] if with_text else None,
        )

    def get_document(self, doc_id: str) -> Document | None:
        with self._lock:
            r = self._conn.execute("SELECT * FROM documents WHERE doc_id=?", (doc_id,)).fetchone()
            if r is None:
                return None
            doc = self._doc(r, with_text=True)
            doc.chunk_list = [
                ChunkSpan(chunk_id=c["chunk_id"], start=int(c["start"]), end=int(c["end"]))
                for c in self._conn.execute(
                    'SELECT chunk_id, start, "end" FROM chunks WHERE doc_id=? ORDER BY ord', (doc_id,)
                )
            ]
        return doc

    def list_documents(self, limit: int, offset: int) -> tuple[list[Document], int]:
        if offset > 2**63 - 1:
            # SQLite's integers are 64-bit: a larger one would not bind (OverflowError, a 500).
            raise InvalidRequest(f"offset: at most {2**63 - 1} (got {offset})", param="offset")
        with self._lock:
            total = int(self._conn.execute("SELECT COUNT(*) FROM documents").fetchone()[0])
            rows = self._conn.execute(
                "SELECT doc_id, title, metadata, n_chunks, created_at, updated_at FROM documents"
                " ORDER BY doc_id LIMIT ? OFFSET ?",
                (limit, offset),
            ).fetchall()
        return [self._doc(r, with_text=False) for r in rows], total

    def chunks_by_vid(self, vids: Sequence[int]) -> dict[int, StoredChunk]:
        out: dict[int, StoredChunk] = {}
        ids = [int(v) for v in vids]
        with self._lock:
            for i in range(0, len(ids), 500):
                part = ids[i : i + 500]
                rows = self._conn.execute(
                    'SELECT c.vid, c.chunk_id, c.doc_id, c.start, c."end", c.text, d.metadata, d.title'
                    " FROM chunks c JOIN documents d ON d.doc_id = c.doc_id"
                    f" WHERE c.vid IN ({','.join('?' * len(part))})",
                    part,
                ).fetchall()
                for r in rows:
                    out[int(r[0])] = StoredChunk(
                        vid=int(r[0]),
                        chunk_id=r[1],
                        doc_id=r[2],
                        start=int(r[3]),
                        end=int(r[4]),
                        text=r[5],
                        metadata=json.loads(r[6]),
                        title=r[7],
                    )
        return out

    def ops_after(self, seq: int, limit: int = 4096) -> list[LoggedOp]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT o.seq, o.kind, o.vid, c.embedding, c.context, c.text FROM ops o"
                " LEFT JOIN chunks c ON c.vid = o.vid AND o.kind = 'add'"
                " WHERE o.seq > ? ORDER BY o.seq LIMIT ?",
                (seq, limit),
            ).fetchall()
        out = []
        for r in rows:
            emb = np.frombuffer(r[3], dtype=np.float32) if r[3] is not None else None
            text = None if r[5] is None else (f"{r[4]}\n{r[5]}" if r[4] else r[5])
            out.append(LoggedOp(int(r[0]), r[1], int(r[2]), emb, text))
        return out

    def last_seq(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COALESCE(MAX(seq), 0) FROM ops").fetchone()[0])

    def counts(self) -> tuple[int, int]:
        """(documents, chunks)."""
        with self._lock:
            docs = int(self._conn.execute("SELECT COUNT(*) FROM documents").fetchone()[0])
            chunks = int(self._conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0])
        return docs, chunks

    def snapshot(self) -> Snapshot:
        """Read in one transaction, so the seq and the chunks agree."""
        with self._lock:
            self._conn.execute("BEGIN")
            try:
                seq = int(self._conn.execute("SELECT COALESCE(MAX(seq), 0) FROM ops").fetchone()[0])
                rows = self._conn.execute(
                    "SELECT vid, embedding, context, text FROM chunks ORDER BY vid"
                ).fetchall()
            finally:
                self._conn.execute("COMMIT")
        return Snapshot(
            seq,
            [
                SnapshotRow(
                    int(r[0]), np.frombuffer(r[1], dtype=np.float32), f"{r[2]}\n{r[3]}" if r[2] else r[3]
                )
                for r in rows
            ],
        )

    def vids_matching(self, where: Filter) -> np.ndarray:
        where_sql, params = to_sql(where)
        with self._lock:
            rows = self._conn.execute(
                f"SELECT c.vid FROM chunks c JOIN documents d ON d.doc_id = c.doc_id WHERE {where_sql}",
                list(params),
            ).fetchall()
        return np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))

    def get_meta(self, key: str) -> str | None:
        with self._lock:
            r = self._conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if r is None else str(r[0])

    def set_meta(self, key: str, value: str) -> None:
        with self._tx() as c:
            c.execute(
                "INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                (key, value),
            )

    def close(self) -> None:
        with self._lock:
            self._conn.close()
