"""One collection: ingestion and search over a store and indexes it is given.

``ChunkedCollection`` holds what every backend shares: chunking, embedding only the chunks
not stored yet, reranking and the typed ``SearchHit``. ``Collection`` is the embedded backend
(SQLite + FAISS + BM25, built by ``backend.EmbeddedBackend`` and injected here);
``services/retrieval/milvus`` is the other.

Durability and recovery (embedded)
----------------------------------
* Writes go to SQLite first (``store.py``): documents, chunks with embeddings, and one
  ``ops`` row per chunk added or removed, in one transaction per batch. That commit is
  the acknowledgement.
* The FAISS and BM25 indexes in memory are derived from the op log: after a write (or,
  for another process's writes, when the store's ``data_version`` moves) the collection
  applies ops past ``applied_seq``.
* Every ``checkpoint_every`` ops the indexes are written as a checkpoint: both index files
  with the seq in their names, then ``checkpoint.json`` naming them, each written
  atomically (temp, fsync, rename). On open, the checkpoint is loaded and the log replayed
  from its seq; a missing, torn or inconsistent checkpoint is dropped and the indexes are
  rebuilt from SQLite. A ``kill -9`` at any moment therefore loses nothing acknowledged,
  leaves no half-written index, and creates no duplicates (chunk ids are unique in SQLite,
  and replay applies each op once).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from services.common.atomic import atomic_write
from services.common.errors import InvalidRequest, ServiceUnavailable
from services.retrieval.core.chunking import make_chunks
from services.retrieval.core.embedder import Embedder
from services.retrieval.core.filters import Filter, parse_filter
from services.retrieval.core.fusion import rrf
from services.retrieval.core.originals import drop_original
from services.retrieval.core.parsing import InputDocument
from services.retrieval.core.reranker import Reranker
from services.retrieval.core.store import (
    ChunkStore,
    DocumentRecord,
    DocumentStore,
    MissingEmbeddings,
    Snapshot,
    StoredChunk,
    WriteResult,
)
from services.retrieval.core.structure import section_window
from services.retrieval.core.vector_index import IndexParams, VectorIndex
from services.retrieval.core.versions import (
    IndexState,
    IndexVersion,
    IndexVersionChanged,
    NotSupported,
    check_dim,
)
from services.retrieval.protocol import Document, SearchResult, located

log = logging.getLogger("tandem.retrieval")

Progress = Callable[[int, int], None]


@dataclass
class CollectionConfig:
    name: str
    embedding_model: str
    model_path: str
    dim: int
    chunk_size: int
    chunk_overlap: int
    index: str
    created_at: float
    # Which backend holds the collection (files before this field existed are embedded ones).
    backend: str = "embedded"
    # How documents and queries are embedded ("torch", "onnx", "onnx-int8"): the one that
    # embedded the stored vectors, so queries use it too (files before this field: torch).
    embedding_backend: str = "torch"
    # Keep the text of uploaded files that a reader cannot see (core/hidden_text.py); files
    # before this field: left out, as for a new collection.
    keep_hidden_text: bool = False
    # Language OCR reads in scanned pages and images (core/ocr.py's LANGUAGES); files before
    # this field: English, as for a new collection.
    ocr_language: str = "en"

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, indent=2).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> CollectionConfig:
        return cls(**json.loads(raw))


@dataclass
class SearchOptions:
    index: IndexParams
    k1: float = 1.2
    b: float = 0.75
    language: str = "english"
    rrf_k: int = 60
    dense_weight: float = 1.0
    sparse_weight: float = 1.0
    hybrid_depth: int = 100
    rerank_depth: int = 50
    checkpoint_every: int = 2000


@dataclass
class IngestResult:
    documents: int
    chunks_added: int
    chunks_removed: int
    chunks_unchanged: int


# One search result: a chunk, its document, and the score of each stage that saw it (``dense``
# cosine, ``sparse`` BM25, ``hybrid`` RRF, ``rerank``). The wire model itself, so the route
# returns hits as they are.
SearchHit = SearchResult


@dataclass
class CandidateIndex:
    """An index version that is not active yet (a reindex's new one): its embedder and a dense
    index of its vectors, searched beside the active sparse index to judge it before a switch."""

    embedder: Embedder
    dense: VectorIndex


@dataclass
class Ranked:
    """First-stage candidates, best first: (chunk, score) pairs and every stage's scores."""

    hits: list[tuple[StoredChunk, float]]
    stages: dict[str, dict[str, float]]  # chunk_id -> stage -> score


@dataclass(frozen=True)
class CollectionParts:
    """What every backend's collection is built from."""

    root: Path  # local folder: uploads waiting for a job (and everything, on the embedded backend)
    config: CollectionConfig
    embedder: Embedder
    options: SearchOptions
    reranker: Reranker | None = None
    # The embedder of an index version (after a switch to another embedder); None: only the
    # collection's own ``embedding_model`` (``embedder``) is available.
    embedders: Callable[[IndexVersion], Embedder] | None = None


class ChunkedCollection:
    """A collection as the API and the ingestion worker use it, on every backend. This half is
    backend-independent: chunking, embedding what is new, committing through a ``ChunkStore``
    with retries, reranking and building hits. A backend supplies ``_first_stage``, ``stats``
    and ``close`` (and may extend ``_after_write``)."""

    def __init__(self, parts: CollectionParts, store: ChunkStore) -> None:
        self.root = parts.root
        self.config = parts.config
        self.embedder = parts.embedder
        # Chunks are cut with the tokenizer of the collection's own embedding_model, whichever
        # embedder its index uses now: a switch re-embeds chunks, it never re-chunks them.
        self.chunker = parts.embedder
        self.options = parts.options
        self.reranker = parts.reranker
        self.store = store

    # -- writes -------------------------------------------------------------
    def prepare(self, docs: Sequence[InputDocument]) -> list[DocumentRecord]:
        """Chunk documents (the last of several with one id wins)."""
        by_id: dict[str, InputDocument] = {}
        for d in docs:
            by_id.pop(d.id, None)
            by_id[d.id] = d
        records = []
        for d in by_id.values():
            chunks = make_chunks(
                d.id,
                d.text,
                title=d.title,
                size=self.config.chunk_size,
                overlap=self.config.chunk_overlap,
                offsets=self.chunker.token_offsets,
                structure=d.structure,
            )
            if not chunks:
                raise InvalidRequest(f"document {d.id!r} has no text to index", param="documents")
            digest = hashlib.sha256(f"{d.title}\x00{d.text}".encode("utf-8", "surrogatepass")).hexdigest()
            records.append(DocumentRecord(d.id, d.text, d.title, d.metadata, digest, chunks))
        return records

    def write(self, records: Sequence[DocumentRecord], progress: Progress | None = None) -> IngestResult:
        """Embed what is new and commit ``records`` (one transaction on the embedded store)."""
        embedder, version = self._writer()
        all_chunks = {c.chunk_id: c for r in records for c in r.chunks}
        known = self.store.existing_chunk_ids(all_chunks)
        todo = [c for cid, c in all_chunks.items() if cid not in known]
        embeddings: dict[str, np.ndarray] = {}
        step = 256
        for s in range(0, len(todo), step):
            part = todo[s : s + step]
            vecs = embedder.embed_documents([c.index_text for c in part])
            embeddings.update({c.chunk_id: v for c, v in zip(part, vecs, strict=True)})
            if progress:
                progress(min(s + step, len(todo)), len(todo))
        res: WriteResult | None = None
        for _attempt in range(5):
            try:
                res = self._commit(records, embeddings, version)
                break
            except MissingEmbeddings as exc:
                # Another writer removed chunks we meant to keep: embed them too and retry.
                part = [all_chunks[c] for c in exc.chunk_ids]
                vecs = embedder.embed_documents([c.index_text for c in part])
                embeddings.update({c.chunk_id: v for c, v in zip(part, vecs, strict=True)})
        if res is None:
            raise ServiceUnavailable("collection is changing too fast; retry", code="write_conflict")
        self._after_write()
        return IngestResult(len(records), res.added, res.removed, res.unchanged)

    def _writer(self) -> tuple[Embedder, int | None]:
        """The embedder of new chunks, and the index version its vectors belong to (None: the
        backend has one version)."""
        return self.embedder, None

    def _commit(
        self, records: Sequence[DocumentRecord], embeddings: dict[str, np.ndarray], version: int | None
    ) -> WriteResult:
        return self.store.write(records, embeddings)

    def _after_write(self) -> None:
        """Hook: make a committed write visible to this process's searches."""

    # -- index versions (embedded backend only, for now) ---------------------
    def versions(self) -> IndexState:
        """The active, previous and building index versions (501 where the backend has none)."""
        raise NotSupported(
            f"switching the embedder of a collection is not supported on the {self.config.backend} "
            "backend yet (TANDEM_RETRIEVAL_BACKEND=embedded supports it)",
            param="embedder",
            code="reindex_not_supported",
        )

    def ingest(self, docs: Sequence[InputDocument], progress: Progress | None = None) -> IngestResult:
        return self.write(self.prepare(docs), progress)

    def delete_document(self, doc_id: str) -> bool:
        found = self.store.delete_document(doc_id)
        if found:
            drop_original(self.root, doc_id)
            self._after_write()
        return found

    def get_document(self, doc_id: str) -> Document | None:
        return self.store.get_document(doc_id)

    def list_documents(self, limit: int, offset: int) -> tuple[list[Document], int]:
        return self.store.list_documents(limit, offset)

    # -- reads --------------------------------------------------------------
    def _first_stage(
        self,
        query: str,
        mode: str,
        where: Filter | None,
        depth: int,
        want: int,
        weights: dict[str, float],
        candidate: CandidateIndex | None = None,
    ) -> Ranked:
        """The backend's ranking of up to ``want`` chunks (``depth`` candidates per ranker);
        with ``candidate``, its dense side is that index version's (a reindex judging it)."""
        raise NotImplementedError

    def search(
        self,
        query: str,
        *,
        top_k: int = 10,
        mode: str = "hybrid",
        filters: dict[str, Any] | None = None,
        rerank: bool = False,
        weights: dict[str, float] | None = None,
        candidate: CandidateIndex | None = None,
    ) -> list[SearchResult]:
        where = parse_filter(filters) if filters else None
        if rerank and self.reranker is None:
            raise InvalidRequest(
                "rerank was requested but no reranker is configured (set TANDEM_RETRIEVAL_RERANKER_MODEL)",
                param="rerank",
                code="reranker_not_configured",
            )
        want = max(top_k, self.options.rerank_depth) if rerank else top_k
        depth = max(want, self.options.hybrid_depth) if mode == "hybrid" else want
        w = {"dense": self.options.dense_weight, "sparse": self.options.sparse_weight, **(weights or {})}
        ranked = self._first_stage(query, mode, where, depth, want, w, candidate)
        hits = ranked.hits[:want]
        if rerank and self.reranker is not None and hits:
            rs = self.reranker.score(query, [c.text for c, _ in hits]).tolist()
            for (c, _), s in zip(hits, rs, strict=True):
                ranked.stages[c.chunk_id]["rerank"] = float(s)
            order = sorted(range(len(hits)), key=lambda i: (-rs[i], hits[i][0].vid))
            hits = [(hits[i][0], float(rs[i])) for i in order]
        return [
            SearchResult(
                chunk_id=c.chunk_id,
                document_id=c.doc_id,
                text=c.text,
                score=float(s),
                scores=ranked.stages[c.chunk_id],
                metadata=c.metadata,
                title=c.title,
                start=c.start,
                end=c.end,
                **located(c.structure),
            )
            for c, s in hits[:top_k]
        ]

    def with_sections(self, hits: list[SearchResult], tokens: int) -> list[SearchResult]:
        """``hits`` with ``section_text``: each chunk's enclosing section, cut to ``tokens`` tokens
        of the collection's model around the chunk (the chunk alone where it is longer)."""
        texts: dict[str, str] = {}
        out = []
        for hit in hits:
            if hit.document_id not in texts:
                doc = self.get_document(hit.document_id)
                texts[hit.document_id] = (doc.text or "") if doc is not None else ""
            text = texts[hit.document_id]
            lo = hit.section_start if hit.section_start is not None else hit.start
            hi = hit.section_end if hit.section_end is not None else hit.end
            start, end = section_window(text, lo, hi, hit.start, hit.end, tokens, self.chunker.token_offsets)
            out.append(hit.model_copy(update={"section_text": text[start:end], "section_text_start": start}))
        return out

    def stats(self) -> dict[str, Any]:
        raise NotImplementedError

    def close(self, checkpoint: bool = True) -> None:
        raise NotImplementedError


class IndexFactory(Protocol):
    """Makes (or loads from a checkpoint) the derived indexes of an embedded collection."""

    def dense(self) -> VectorIndex: ...

    def sparse(self) -> SparseIndex: ...

    def dense_from(self, raw: bytes) -> VectorIndex: ...

    def sparse_from(self, raw: bytes) -> SparseIndex: ...

    def for_dim(self, dim: int) -> IndexFactory:
        """The same indexes for vectors of ``dim`` (an index version of another embedder)."""
        ...


class SparseIndex(Protocol):
    """A lexical index over chunk vids (``sparse.IncrementalBM25``)."""

    n_live: int

    def add(self, vids: Sequence[int], texts: Sequence[str]) -> None: ...

    def remove(self, vids: Sequence[int]) -> None: ...

    def live(self, vids: np.ndarray) -> np.ndarray: ...

    def search(
        self, query: str, k: int, allowed: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]: ...

    def needs_merge(self) -> bool: ...

    def merge(self) -> None: ...

    def to_bytes(self) -> bytes: ...


class Collection(ChunkedCollection):
    """The embedded backend: a ``DocumentStore`` (the source of truth and op log) and the dense
    and sparse indexes derived from it, all injected."""

    def __init__(self, parts: CollectionParts, store: DocumentStore, indexes: IndexFactory) -> None:
        super().__init__(parts, store)
        self.store: DocumentStore = store
        self.indexes = indexes
        self.index_dir = parts.root / "index"
        self._lock = threading.RLock()
        self._ckpt_lock = threading.Lock()
        self.embedders = parts.embedders
        # The index version the in-memory indexes (and ``embedder``) are of.
        self.version = self.store.init_versions(
            IndexVersion(1, self.config.embedding_model, self.config.model_path, self.config.dim)
        ).active
        self.embedder = self._embedder_of(self.version)
        self.indexes = indexes.for_dim(self.version.dim)
        # One switch of this process's indexes to another version at a time.
        self._switch_lock = threading.Lock()
        self.dense = self.indexes.dense()
        self.sparse = self.indexes.sparse()
        self.applied_seq = 0
        self.checkpoint_seq = 0
        self._data_version = -1
        self._load()

    def _embedder_of(self, version: IndexVersion) -> Embedder:
        if version.model_path == self.config.model_path and version.dim == self.config.dim:
            return self.chunker  # the collection's own model
        if self.embedders is None:
            raise NotSupported(
                f"collection {self.config.name!r} uses embedder {version.embedder!r}, which this "
                "process cannot load",
                param="embedder",
            )
        return self.embedders(version)

    # -- recovery -----------------------------------------------------------
    def _load(self) -> None:
        t0 = time.monotonic()
        loaded = self._load_checkpoint()
        if not loaded:
            self._rebuild()
        self.catch_up()
        _docs, chunks = self.store.counts()
        if len(self.dense) != chunks or self.sparse.n_live != chunks:
            log.warning(
                "collection %s: indexes hold %d/%d chunks, store %d; rebuilding from the store",
                self.config.name,
                len(self.dense),
                self.sparse.n_live,
                chunks,
            )
            self._rebuild()
            self.catch_up()
        log.info(
            "collection %s open: %d chunks, seq %d (%s) in %.2fs",
            self.config.name,
            chunks,
            self.applied_seq,
            "checkpoint + replay" if loaded else "rebuilt",
            time.monotonic() - t0,
        )

    def _load_checkpoint(self) -> bool:
        manifest = self.index_dir / "checkpoint.json"
        if not manifest.exists():
            return False
        try:
            meta = json.loads(manifest.read_bytes())
            seq = int(meta["seq"])
            # A checkpoint of before the version field is of version 1, the only one then.
            if int(meta.get("version", 1)) != self.version.version:
                raise ValueError(
                    f"checkpoint of index version {meta.get('version', 1)}, active is {self.version.version}"
                )
            if seq > self.store.last_seq():
                raise ValueError(f"checkpoint seq {seq} is ahead of the log ({self.store.last_seq()})")
            dense_raw = (self.index_dir / meta["dense"]).read_bytes()
            sparse_raw = (self.index_dir / meta["sparse"]).read_bytes()
            if hashlib.sha256(dense_raw).hexdigest() != meta["dense_sha256"]:
                raise ValueError("dense index checksum mismatch")
            if hashlib.sha256(sparse_raw).hexdigest() != meta["sparse_sha256"]:
                raise ValueError("sparse index checksum mismatch")
            self.dense = self.indexes.dense_from(dense_raw)
            self.sparse = self.indexes.sparse_from(sparse_raw)
            self.applied_seq = self.checkpoint_seq = seq
            return True
        except Exception as exc:  # any damage means: ignore it, rebuild from the source of truth
            log.warning("collection %s: unusable index checkpoint (%s); rebuilding", self.config.name, exc)
            return False

    def _rebuild(self) -> None:
        """Build both indexes from the store, of the active version (adopting it, and its
        embedder, when another process switched the collection)."""
        for _attempt in range(5):
            state = self.store.index_state()
            if state.active.version == self.version.version:
                version, embedder, indexes = self.version, self.embedder, self.indexes
            else:
                version, embedder = state.active, self._embedder_of(state.active)
                indexes = self.indexes.for_dim(version.dim)
            snap = self.store.snapshot()
            if snap.version != version.version:
                continue  # switched again between the two reads
            dense, sparse = self._build(snap, indexes)
            with self._lock:
                if version.version != self.version.version:
                    log.info(
                        "collection %s: index version %d (%s) is active now",
                        self.config.name,
                        version.version,
                        version.embedder,
                    )
                self.version, self.embedder, self.indexes = version, embedder, indexes
                self.dense, self.sparse = dense, sparse
                self.applied_seq = snap.seq
                self.checkpoint_seq = 0
            return
        raise ServiceUnavailable("collection is switching index versions; retry", code="index_switching")

    @staticmethod
    def _build(snap: Snapshot, indexes: IndexFactory) -> tuple[VectorIndex, SparseIndex]:
        dense, sparse = indexes.dense(), indexes.sparse()
        for s in range(0, len(snap.rows), 4096):
            part = snap.rows[s : s + 4096]
            vids = np.array([r.vid for r in part], dtype=np.int64)
            dense.add(vids, np.stack([r.embedding for r in part]))
            sparse.add(vids.tolist(), [r.index_text for r in part])
        sparse.merge()
        return dense, sparse

    def catch_up(self) -> int:
        """Apply logged ops past ``applied_seq`` (this process's writes or another's)."""
        applied = 0
        switched = False
        with self._lock:
            self._data_version = self.store.data_version()
            while True:
                version, ops = self.store.versioned_ops_after(self.applied_seq)
                if version != self.version.version:
                    # Another version's vectors: these indexes cannot take them. Rebuilt below,
                    # outside the lock, so searches keep answering from these meanwhile.
                    switched = True
                    break
                if not ops:
                    break
                i = 0
                while i < len(ops):
                    j = i
                    while j < len(ops) and ops[j].kind == ops[i].kind:
                        j += 1
                    run = ops[i:j]
                    if run[0].kind == "add":
                        live = [o for o in run if o.embedding is not None]
                        if live:
                            vids = np.array([o.vid for o in live], dtype=np.int64)
                            self.dense.add(vids, np.stack([o.embedding for o in live]))  # type: ignore[misc]
                            self.sparse.add(vids.tolist(), [o.index_text or "" for o in live])
                    else:
                        vids = np.array([o.vid for o in run], dtype=np.int64)
                        present = self.sparse.live(vids)
                        self.dense.remove(present)
                        self.sparse.remove(present.tolist())
                    i = j
                self.applied_seq = ops[-1].seq
                applied += len(ops)
            if self.sparse.needs_merge():
                self.sparse.merge()
        if switched:
            if not self._switch_lock.acquire(blocking=False):
                return applied  # another thread is switching; the old version answers meanwhile
            try:
                self._rebuild()
            finally:
                self._switch_lock.release()
            return applied + self.catch_up()
        if self.applied_seq - self.checkpoint_seq >= self.options.checkpoint_every:
            # Off the request path; at most one runs at a time (checkpoint() returns if busy).
            threading.Thread(target=self._checkpoint_quietly, daemon=True).start()
        return applied

    def _checkpoint_quietly(self) -> None:
        try:
            self.checkpoint()
        except Exception:
            log.exception("collection %s: checkpoint failed", self.config.name)

    def _after_write(self) -> None:
        self.catch_up()

    def refresh(self) -> None:
        """Catch up if another connection (e.g. the ingestion worker) committed meanwhile."""
        if self.store.data_version() != self._data_version:
            self.catch_up()

    def checkpoint(self) -> None:
        """Write both indexes and the manifest atomically; old checkpoint files are removed after."""
        if not self._ckpt_lock.acquire(blocking=False):
            return  # one already running
        try:
            with self._lock:
                seq = self.applied_seq
                if seq == self.checkpoint_seq:
                    return
                version = self.version.version
                dense_raw = self.dense.to_bytes()
                sparse_raw = self.sparse.to_bytes()
            dense_name, sparse_name = f"dense-{seq}.npz", f"sparse-{seq}.npz"
            atomic_write(self.index_dir / dense_name, dense_raw)
            atomic_write(self.index_dir / sparse_name, sparse_raw)
            manifest = {
                "seq": seq,
                "version": version,
                "dense": dense_name,
                "sparse": sparse_name,
                "dense_sha256": hashlib.sha256(dense_raw).hexdigest(),
                "sparse_sha256": hashlib.sha256(sparse_raw).hexdigest(),
                "written_at": time.time(),
            }
            atomic_write(self.index_dir / "checkpoint.json", json.dumps(manifest).encode())
            self.checkpoint_seq = seq
            for old in self.index_dir.glob("*.npz"):
                if old.name not in (dense_name, sparse_name):
                    old.unlink(missing_ok=True)
        finally:
            self._ckpt_lock.release()

    # -- reads --------------------------------------------------------------
    def _first_stage(
        self,
        query: str,
        mode: str,
        where: Filter | None,
        depth: int,
        want: int,
        weights: dict[str, float],
        candidate: CandidateIndex | None = None,
    ) -> Ranked:
        self.refresh()
        allowed = None
        if where is not None:
            allowed = np.sort(self.store.vids_matching(where))
            if not len(allowed):
                return Ranked([], {})
        stage: dict[int, dict[str, float]] = {}
        rankings: dict[str, np.ndarray] = {}
        with self._lock:
            # One version's embedder and dense index together (a switch may swap both meanwhile).
            embedder, dense = (
                (candidate.embedder, candidate.dense)
                if candidate is not None
                else (self.embedder, self.dense)
            )
        if mode in ("dense", "hybrid"):
            qv = embedder.embed_query(query)
            with self._lock:
                ids, scores = dense.search(qv, depth, allowed)
            rankings["dense"] = ids
            for v, s in zip(ids.tolist(), scores.tolist(), strict=True):
                stage.setdefault(v, {})["dense"] = s
        if mode in ("sparse", "hybrid"):
            with self._lock:
                ids, scores = self.sparse.search(query, depth, allowed)
            rankings["sparse"] = ids
            for v, s in zip(ids.tolist(), scores.tolist(), strict=True):
                stage.setdefault(v, {})["sparse"] = s
        if mode == "hybrid":
            ranked = rrf(rankings, weights, self.options.rrf_k)
            for v, s in ranked:
                stage[v]["hybrid"] = s
        else:
            ranked = [(int(v), stage[int(v)][mode]) for v in rankings[mode].tolist()]
        ranked = ranked[:want]
        chunks = self.store.chunks_by_vid([v for v, _ in ranked])
        # a chunk missing from the store was deleted since the index search
        return Ranked(
            [(chunks[v], s) for v, s in ranked if v in chunks],
            {chunks[v].chunk_id: stage[v] for v, _ in ranked if v in chunks},
        )

    def stats(self) -> dict[str, Any]:
        self.refresh()
        docs, chunks = self.store.counts()
        with self._lock:
            dense, sparse = len(self.dense), self.sparse.n_live
        state = self.versions()
        return {
            "documents": docs,
            "chunks": chunks,
            "index_type": self.dense.kind,
            "indexed": {"dense": dense, "sparse": sparse},
            "dimension": state.active.dim,
            "embedder": state.active.embedder,
            "index_version": state.active.version,
            "previous_version": state.previous.version if state.previous else None,
            "previous_embedder": state.previous.embedder if state.previous else None,
            "reindexing": (
                {
                    "job_id": state.building.job_id,
                    "embedder": state.building.embedder,
                    "index_version": state.building.version,
                }
                if state.building
                else None
            ),
        }

    # -- writes under index versions -----------------------------------------
    def _writer(self) -> tuple[Embedder, int | None]:
        with self._lock:
            return self.embedder, self.version.version

    def _commit(
        self, records: Sequence[DocumentRecord], embeddings: dict[str, np.ndarray], version: int | None
    ) -> WriteResult:
        return self.store.write(records, embeddings, version)

    def write(self, records: Sequence[DocumentRecord], progress: Progress | None = None) -> IngestResult:
        for _attempt in range(3):
            try:
                return super().write(records, progress)
            except IndexVersionChanged:
                # Switched while these were embedded: adopt the new version (once another
                # thread's adoption, if one runs, has ended) and embed with its model.
                with self._switch_lock:
                    pass
                self.catch_up()
        raise ServiceUnavailable("collection is switching index versions; retry", code="index_switching")

    # -- index versions ---------------------------------------------------------
    def versions(self) -> IndexState:
        return self.store.index_state()

    def switch_to(
        self,
        target: IndexVersion,
        embedder: Embedder,
        busy: Callable[[IndexVersion], bool],
        hook: Callable[[str], None] | None = None,
    ) -> IndexState:
        """Make ``target`` active (``store.switch_to``) and this process's indexes follow it."""
        check_dim(target.embedder, embedder.dim, target.dim, f"index version {target.version}")

        def embed(rows: list[tuple[int, str]]) -> np.ndarray:
            if hook is not None:
                hook("in_switch")  # inside the switch's transaction
            return embedder.embed_documents([t for _, t in rows])

        state = self.store.switch_to(target, embed, busy)
        self.catch_up()
        return state

    def close(self, checkpoint: bool = True) -> None:
        if checkpoint:
            try:
                self.checkpoint()
            except OSError as exc:
                log.warning("collection %s: checkpoint on close failed: %s", self.config.name, exc)
        self.store.close()
