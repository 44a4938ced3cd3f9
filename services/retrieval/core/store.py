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
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from services.common.errors import Conflict, InvalidRequest
from services.retrieval.core.filters import Filter, to_sql
from services.retrieval.core.versions import (
    ACTIVE,
    BUILDING,
    PREVIOUS,
    IndexState,
    IndexVersion,
    IndexVersionChanged,
    VersionSuperseded,
)
from services.retrieval.protocol import ChunkSpan, Document, located

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
    embedding BLOB NOT NULL,
    structure TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS chunks_doc ON chunks(doc_id);
CREATE TABLE IF NOT EXISTS ops (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL CHECK (kind IN ('add', 'del')),
    vid INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
-- Vectors of index versions other than the active one (see versions.py): the one a reindex
-- builds and the previous one kept for a rollback.
CREATE TABLE IF NOT EXISTS staged (
    version INTEGER NOT NULL,
    vid INTEGER NOT NULL,
    embedding BLOB NOT NULL,
    PRIMARY KEY (version, vid)
) WITHOUT ROWID;
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
    # Where the chunk is in its document (core/structure.py: section, pages, anchor...).
    structure: dict[str, Any] = field(default_factory=dict)

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
    structure: dict[str, Any] = field(default_factory=dict)


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
    full index rebuild. ``version``: the index version whose vectors the rows hold."""

    seq: int
    rows: list[SnapshotRow]
    version: int = 1


# (vid, index text) of chunks to embed -> their vectors, float32 [n, dim]
EmbedMissing = Callable[[list[tuple[int, str]]], np.ndarray]


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

    # Index versions (versions.py): see SQLiteDocumentStore for what each does.
    def write(
        self, docs: Sequence[DocumentRecord], embeddings: dict[str, np.ndarray], version: int | None = None
    ) -> WriteResult: ...

    def versioned_ops_after(self, seq: int, limit: int = 4096) -> tuple[int, list[LoggedOp]]: ...

    def init_versions(self, first: IndexVersion) -> IndexState: ...

    def index_state(self) -> IndexState: ...

    def begin_build(
        self, make: Callable[[int], IndexVersion], busy: Callable[[IndexVersion], bool]
    ) -> IndexVersion: ...

    def abandon_build(self, version: int) -> None: ...

    def unstaged(self, version: int, limit: int = 256) -> list[tuple[int, str]]: ...

    def staged_count(self, version: int) -> int: ...

    def staged_vectors(self, version: int) -> tuple[np.ndarray, np.ndarray]: ...

    def stage(self, version: int, vids: Sequence[int], vecs: np.ndarray) -> None: ...

    def switch_to(
        self, target: IndexVersion, embed_missing: EmbedMissing, busy: Callable[[IndexVersion], bool]
    ) -> IndexState: ...


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
        columns = {r[1] for r in self._conn.execute("PRAGMA table_info(chunks)")}
        if "structure" not in columns:  # a store of before chunks knew their structure
            self._conn.execute("ALTER TABLE chunks ADD COLUMN structure TEXT NOT NULL DEFAULT '{}'")

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

    def write(
        self, docs: Sequence[DocumentRecord], embeddings: dict[str, np.ndarray], version: int | None = None
    ) -> WriteResult:
        """Insert or replace ``docs`` in one transaction. Chunks whose content-derived id already
        exists are kept as they are (re-ingesting the same text changes nothing); chunks no
        longer produced are removed. ``embeddings`` must cover every chunk not yet stored.
        With ``version``, the vectors are that index version's: if another is active now
        (switched meanwhile), nothing is written (``IndexVersionChanged``)."""
        added = removed = unchanged = 0
        now = time.time()
        with self._tx() as c:
            if version is not None and self._state(c).active.version != version:
                raise IndexVersionChanged(f"index version {version} is no longer active")
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
                        'INSERT INTO chunks(chunk_id, doc_id, ord, start, "end", text, context, embedding,'
                        " structure) VALUES (?,?,?,?,?,?,?,?,?)",
                        (
                            ch.chunk_id,
                            doc.doc_id,
                            ch.ord,
                            ch.start,
                            ch.end,
                            ch.text,
                            ch.context,
                            vec.tobytes(),
                            json.dumps(ch.structure, ensure_ascii=False),
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
                ChunkSpan(
                    chunk_id=c["chunk_id"],
                    start=int(c["start"]),
                    end=int(c["end"]),
                    context=c["context"],
                    **located(json.loads(c["structure"] or "{}")),
                )
                for c in self._conn.execute(
                    'SELECT chunk_id, start, "end", context, structure FROM chunks WHERE doc_id=? ORDER BY ord',
                    (doc_id,),
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
                    'SELECT c.vid, c.chunk_id, c.doc_id, c.start, c."end", c.text, d.metadata, d.title,'
                    " c.structure FROM chunks c JOIN documents d ON d.doc_id = c.doc_id"
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
                        structure=json.loads(r[8] or "{}"),
                    )
        return out

    def ops_after(self, seq: int, limit: int = 4096) -> list[LoggedOp]:
        return self.versioned_ops_after(seq, limit)[1]

    def versioned_ops_after(self, seq: int, limit: int = 4096) -> tuple[int, list[LoggedOp]]:
        """(the active index version, the ops after ``seq``), read together: an op's vector is
        read from ``chunks`` now, so it is the vector of the version read with it."""
        with self._read() as c:
            version = self._active_number(c)
            rows = c.execute(
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
        return version, out

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
        with self._read() as c:
            seq = int(c.execute("SELECT COALESCE(MAX(seq), 0) FROM ops").fetchone()[0])
            rows = c.execute("SELECT vid, embedding, context, text FROM chunks ORDER BY vid").fetchall()
            version = self._active_number(c)
        return Snapshot(
            seq,
            [
                SnapshotRow(
                    int(r[0]), np.frombuffer(r[1], dtype=np.float32), f"{r[2]}\n{r[3]}" if r[2] else r[3]
                )
                for r in rows
            ],
            version,
        )

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """A read transaction: what is read inside it is one consistent state."""
        with self._lock:
            self._conn.execute("BEGIN")
            try:
                yield self._conn
            finally:
                self._conn.execute("COMMIT")

    def vids_matching(self, where: Filter) -> np.ndarray:
        where_sql, params = to_sql(where)
        with self._lock:
            rows = self._conn.execute(
                f"SELECT c.vid FROM chunks c JOIN documents d ON d.doc_id = c.doc_id WHERE {where_sql}",
                list(params),
            ).fetchall()
        return np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))

    # -- index versions (versions.py) ----------------------------------------------
    @staticmethod
    def _version_row(c: sqlite3.Connection, key: str) -> IndexVersion | None:
        r = c.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if r is None else IndexVersion.from_json(r[0])

    def _state(self, c: sqlite3.Connection) -> IndexState:
        active = self._version_row(c, ACTIVE)
        if active is None:
            raise RuntimeError(f"{self.path}: no active index version (init_versions was not called)")
        return IndexState(active, self._version_row(c, PREVIOUS), self._version_row(c, BUILDING))

    def _active_number(self, c: sqlite3.Connection) -> int:
        active = self._version_row(c, ACTIVE)
        return 1 if active is None else active.version

    @staticmethod
    def _put(c: sqlite3.Connection, key: str, v: IndexVersion | None) -> None:
        if v is None:
            c.execute("DELETE FROM meta WHERE key=?", (key,))
        else:
            c.execute(
                "INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                (key, v.to_json()),
            )

    def init_versions(self, first: IndexVersion) -> IndexState:
        """The collection's index versions; ``first`` becomes the active one of a store that has
        none yet (a new collection, or one made before versions existed)."""
        with self._read() as c:
            if self._version_row(c, ACTIVE) is not None:
                return self._state(c)
        with self._tx() as c:
            if self._version_row(c, ACTIVE) is None:
                self._put(c, ACTIVE, first)
            return self._state(c)

    def index_state(self) -> IndexState:
        with self._read() as c:
            return self._state(c)

    def begin_build(
        self, make: Callable[[int], IndexVersion], busy: Callable[[IndexVersion], bool]
    ) -> IndexVersion:
        """Record the version a reindex will build (numbered after every version known) and
        return it. One whose job still runs (``busy``) is a 409; an abandoned one (its job failed
        or vanished) is dropped with its staged vectors."""
        with self._tx() as c:
            state = self._state(c)
            if state.building is not None:
                if busy(state.building):
                    raise _reindex_running(state.building)
                c.execute("DELETE FROM staged WHERE version=?", (state.building.version,))
            target = make(state.top() + 1)
            self._put(c, BUILDING, target)
        return target

    def abandon_build(self, version: int) -> None:
        """Drop the build of ``version`` (its job failed for good) and its staged vectors."""
        with self._tx() as c:
            building = self._version_row(c, BUILDING)
            if building is not None and building.version == version:
                c.execute("DELETE FROM staged WHERE version=?", (version,))
                self._put(c, BUILDING, None)

    def unstaged(self, version: int, limit: int = 256) -> list[tuple[int, str]]:
        """(vid, index text) of up to ``limit`` chunks with no vector of ``version`` yet."""
        with self._lock:
            return self._unstaged(self._conn, version, limit)

    @staticmethod
    def _unstaged(c: sqlite3.Connection, version: int, limit: int = -1) -> list[tuple[int, str]]:
        rows = c.execute(
            "SELECT vid, context, text FROM chunks c WHERE NOT EXISTS"
            " (SELECT 1 FROM staged s WHERE s.version=? AND s.vid=c.vid) ORDER BY vid LIMIT ?",
            (version, limit),
        ).fetchall()
        return [(int(r[0]), f"{r[1]}\n{r[2]}" if r[1] else r[2]) for r in rows]

    def staged_count(self, version: int) -> int:
        """Chunks that have a vector of ``version`` (staged for a chunk since deleted not counted)."""
        with self._lock:
            return int(
                self._conn.execute(
                    "SELECT COUNT(*) FROM staged s JOIN chunks c ON c.vid = s.vid WHERE s.version=?",
                    (version,),
                ).fetchone()[0]
            )

    def staged_vectors(self, version: int) -> tuple[np.ndarray, np.ndarray]:
        """(vids, vectors) of the chunks that have a vector of ``version`` (being built)."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT s.vid, s.embedding FROM staged s JOIN chunks c ON c.vid = s.vid"
                " WHERE s.version=? ORDER BY s.vid",
                (version,),
            ).fetchall()
        vids = np.array([int(r[0]) for r in rows], dtype=np.int64)
        if not rows:
            return vids, np.zeros((0, 0), dtype=np.float32)
        return vids, np.stack([np.frombuffer(r[1], dtype=np.float32) for r in rows])

    @staticmethod
    def _insert_staged(c: sqlite3.Connection, version: int, vids: Sequence[int], vecs: np.ndarray) -> None:
        c.executemany(
            "INSERT OR REPLACE INTO staged(version, vid, embedding) VALUES (?,?,?)",
            [
                (version, int(v), np.ascontiguousarray(e, dtype=np.float32).tobytes())
                for v, e in zip(vids, vecs, strict=True)
            ],
        )

    def stage(self, version: int, vids: Sequence[int], vecs: np.ndarray) -> None:
        """Store vectors of ``version`` (being built, or the previous one) for chunks."""
        with self._tx() as c:
            state = self._state(c)
            wanted = {v.version for v in (state.building, state.previous) if v is not None}
            if version not in wanted:
                raise VersionSuperseded(f"index version {version} is not being built")
            self._insert_staged(c, version, vids, vecs)

    def switch_to(
        self,
        target: IndexVersion,
        embed_missing: EmbedMissing,
        busy: Callable[[IndexVersion], bool],
    ) -> IndexState:
        """Make ``target`` (the version being built, or the previous one) active in one
        transaction: chunks still without its vector (written since they were staged) are
        embedded here, under the write lock, so none is missed; the active vectors become the
        previous version (the one previous before is dropped). Returns the new state."""
        with self._tx() as c:
            state = self._state(c)
            if target.version == state.active.version:
                return state
            is_build = state.building is not None and state.building.version == target.version
            is_previous = state.previous is not None and state.previous.version == target.version
            if not (is_build or is_previous):
                raise VersionSuperseded(f"index version {target.version} is neither being built nor previous")
            if not is_build and state.building is not None and busy(state.building):
                raise _reindex_running(state.building)
            missing = self._unstaged(c, target.version)
            vecs = embed_missing(missing)  # called even with none missing: a test's crash point
            if missing:
                self._insert_staged(c, target.version, [v for v, _ in missing], vecs)
            if state.previous is not None and not is_previous:
                c.execute("DELETE FROM staged WHERE version=?", (state.previous.version,))
            old = state.active.version
            c.execute("DELETE FROM staged WHERE version=?", (old,))
            c.execute(
                "INSERT INTO staged(version, vid, embedding) SELECT ?, vid, embedding FROM chunks", (old,)
            )
            c.execute(
                "UPDATE chunks SET embedding = (SELECT s.embedding FROM staged s"
                " WHERE s.version=? AND s.vid=chunks.vid)",
                (target.version,),
            )
            c.execute("DELETE FROM staged WHERE version=?", (target.version,))
            # A staged vector of a chunk deleted since is never needed again.
            c.execute("DELETE FROM staged WHERE vid NOT IN (SELECT vid FROM chunks)")
            self._put(c, ACTIVE, target)
            self._put(c, PREVIOUS, state.active)
            if is_build:
                self._put(c, BUILDING, None)
            return self._state(c)

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _reindex_running(building: IndexVersion) -> Conflict:
    return Conflict(
        f"a reindex to embedder {building.embedder!r} (job {building.job_id}, index version "
        f"{building.version}) is running; wait for it to end",
        param="embedder",
        code="reindex_running",
    )
