"""One collection: its store, its indexes, ingestion and search.

Durability and recovery
-----------------------
* Writes go to SQLite first (``store.py``): documents, chunks with embeddings, and one
  ``ops`` row per chunk added or removed, in one transaction per batch. That commit is
  the acknowledgement.
* The FAISS and BM25 indexes in memory are derived from the op log: after a write (or,
  for another process's writes, when SQLite's ``data_version`` moves) the collection
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from services.common.errors import InvalidRequest, ServiceUnavailable
from services.retrieval.core.atomic import atomic_write
from services.retrieval.core.chunking import make_chunks
from services.retrieval.core.embedder import Embedder
from services.retrieval.core.filters import compile_filter
from services.retrieval.core.fusion import rrf
from services.retrieval.core.reranker import Reranker
from services.retrieval.core.sparse import Bm25Tokenizer, IncrementalBM25
from services.retrieval.core.store import DocumentRecord, MissingEmbeddings, SQLiteDocumentStore
from services.retrieval.core.vector_index import FaissIndex, IndexParams

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
class InputDocument:
    id: str
    text: str
    title: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class IngestResult:
    documents: int
    chunks_added: int
    chunks_removed: int
    chunks_unchanged: int


class Collection:
    def __init__(
        self,
        root: Path,
        config: CollectionConfig,
        embedder: Embedder,
        options: SearchOptions,
        reranker: Reranker | None = None,
    ) -> None:
        self.root = root
        self.config = config
        self.embedder = embedder
        self.options = options
        self.reranker = reranker
        self.store = SQLiteDocumentStore(root / "chunks.sqlite3")
        self.index_dir = root / "index"
        self._lock = threading.RLock()
        self._ckpt_lock = threading.Lock()
        self._tokenizer = Bm25Tokenizer(options.language)
        self.dense = FaissIndex(config.dim, options.index)
        self.sparse = IncrementalBM25(self._tokenizer, options.k1, options.b)
        self.applied_seq = 0
        self.checkpoint_seq = 0
        self._data_version = -1
        self._load()

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
            if seq > self.store.last_seq():
                raise ValueError(f"checkpoint seq {seq} is ahead of the log ({self.store.last_seq()})")
            dense_raw = (self.index_dir / meta["dense"]).read_bytes()
            sparse_raw = (self.index_dir / meta["sparse"]).read_bytes()
            if hashlib.sha256(dense_raw).hexdigest() != meta["dense_sha256"]:
                raise ValueError("dense index checksum mismatch")
            if hashlib.sha256(sparse_raw).hexdigest() != meta["sparse_sha256"]:
                raise ValueError("sparse index checksum mismatch")
            self.dense = FaissIndex.from_bytes(dense_raw, self.config.dim, self.options.index)
            self.sparse = IncrementalBM25.from_bytes(
                sparse_raw, self._tokenizer, self.options.k1, self.options.b
            )
            self.applied_seq = self.checkpoint_seq = seq
            return True
        except Exception as exc:  # any damage means: ignore it, rebuild from the source of truth
            log.warning("collection %s: unusable index checkpoint (%s); rebuilding", self.config.name, exc)
            return False

    def _rebuild(self) -> None:
        seq, rows = self.store.snapshot()
        dense = FaissIndex(self.config.dim, self.options.index)
        sparse = IncrementalBM25(self._tokenizer, self.options.k1, self.options.b)
        for s in range(0, len(rows), 4096):
            part = rows[s : s + 4096]
            vids = np.array([r[0] for r in part], dtype=np.int64)
            dense.add(vids, np.stack([r[1] for r in part]))
            sparse.add(vids.tolist(), [r[2] for r in part])
        sparse.merge()
        with self._lock:
            self.dense, self.sparse = dense, sparse
            self.applied_seq = seq
            self.checkpoint_seq = 0

    def catch_up(self) -> int:
        """Apply logged ops past ``applied_seq`` (this process's writes or another's)."""
        applied = 0
        with self._lock:
            self._data_version = self.store.data_version()
            while True:
                ops = self.store.ops_after(self.applied_seq)
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
                        present = vids[vids < self.sparse.n_rows]
                        present = present[self.sparse.alive.buf[present]] if len(present) else present
                        self.dense.remove(present)
                        self.sparse.remove(present.tolist())
                    i = j
                self.applied_seq = ops[-1].seq
                applied += len(ops)
            if self.sparse.needs_merge():
                self.sparse.merge()
        if self.applied_seq - self.checkpoint_seq >= self.options.checkpoint_every:
            # Off the request path; at most one runs at a time (checkpoint() returns if busy).
            threading.Thread(target=self._checkpoint_quietly, daemon=True).start()
        return applied

    def _checkpoint_quietly(self) -> None:
        try:
            self.checkpoint()
        except Exception:
            log.exception("collection %s: checkpoint failed", self.config.name)

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
                dense_raw = self.dense.to_bytes()
                sparse_raw = self.sparse.to_bytes()
            dense_name, sparse_name = f"dense-{seq}.npz", f"sparse-{seq}.npz"
            atomic_write(self.index_dir / dense_name, dense_raw)
            atomic_write(self.index_dir / sparse_name, sparse_raw)
            manifest = {
                "seq": seq,
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
                offsets=self.embedder.token_offsets,
            )
            if not chunks:
                raise InvalidRequest(f"document {d.id!r} has no text to index", param="documents")
            digest = hashlib.sha256(f"{d.title}\x00{d.text}".encode("utf-8", "surrogatepass")).hexdigest()
            records.append(DocumentRecord(d.id, d.text, d.title, d.metadata, digest, chunks))
        return records

    def write(self, records: Sequence[DocumentRecord], progress: Progress | None = None) -> IngestResult:
        """Embed what is new and commit ``records`` in one transaction."""
        all_chunks = {c.chunk_id: c for r in records for c in r.chunks}
        known = self.store.existing_chunk_ids(all_chunks)
        todo = [c for cid, c in all_chunks.items() if cid not in known]
        embeddings: dict[str, np.ndarray] = {}
        step = 256
        for s in range(0, len(todo), step):
            part = todo[s : s + step]
            vecs = self.embedder.embed_documents([c.index_text for c in part])
            embeddings.update({c.chunk_id: v for c, v in zip(part, vecs, strict=True)})
            if progress:
                progress(min(s + step, len(todo)), len(todo))
        for _attempt in range(5):
            try:
                res = self.store.write(records, embeddings)
                break
            except MissingEmbeddings as exc:
                # Another writer removed chunks we meant to keep: embed them too and retry.
                part = [all_chunks[c] for c in exc.chunk_ids]
                vecs = self.embedder.embed_documents([c.index_text for c in part])
                embeddings.update({c.chunk_id: v for c, v in zip(part, vecs, strict=True)})
        else:
            raise ServiceUnavailable("collection is changing too fast; retry", code="write_conflict")
        self.catch_up()
        return IngestResult(len(records), res.added, res.removed, res.unchanged)

    def ingest(self, docs: Sequence[InputDocument], progress: Progress | None = None) -> IngestResult:
        return self.write(self.prepare(docs), progress)

    def delete_document(self, doc_id: str) -> bool:
        found = self.store.delete_document(doc_id)
        if found:
            self.catch_up()
        return found

    # -- reads --------------------------------------------------------------
    def search(
        self,
        query: str,
        *,
        top_k: int = 10,
        mode: str = "hybrid",
        filters: dict[str, Any] | None = None,
        rerank: bool = False,
        weights: dict[str, float] | None = None,
    ) -> list[dict[str, Any]]:
        self.refresh()
        allowed = None
        if filters:
            sql, params = compile_filter(filters)
            allowed = np.sort(self.store.vids_where(sql, params))
            if not len(allowed):
                return []
        want = max(top_k, self.options.rerank_depth) if rerank else top_k
        depth = max(want, self.options.hybrid_depth) if mode == "hybrid" else want
        stage: dict[int, dict[str, float]] = {}
        rankings: dict[str, np.ndarray] = {}
        if mode in ("dense", "hybrid"):
            qv = self.embedder.embed_query(query)
            with self._lock:
                ids, scores = self.dense.search(qv, depth, allowed)
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
            w = {"dense": self.options.dense_weight, "sparse": self.options.sparse_weight, **(weights or {})}
            ranked = rrf(rankings, w, self.options.rrf_k)
            for v, s in ranked:
                stage[v]["hybrid"] = s
        else:
            ranked = [(int(v), stage[int(v)][mode]) for v in rankings[mode].tolist()]
        ranked = ranked[:want]
        chunks = self.store.chunks_by_vid([v for v, _ in ranked])
        ranked = [(v, s) for v, s in ranked if v in chunks]  # deleted since the index search
        if rerank:
            if self.reranker is None:
                raise InvalidRequest(
                    "rerank was requested but no reranker is configured (set TANDEM_RETRIEVAL_RERANKER_MODEL)",
                    param="rerank",
                    code="reranker_not_configured",
                )
            rs = self.reranker.score(query, [chunks[v].text for v, _ in ranked])
            for (v, _), s in zip(ranked, rs.tolist(), strict=True):
                stage[v]["rerank"] = float(s)
            ranked = sorted(
                ((v, float(s)) for (v, _), s in zip(ranked, rs.tolist(), strict=True)),
                key=lambda x: (-x[1], x[0]),
            )
        out = []
        for v, s in ranked[:top_k]:
            c = chunks[v]
            out.append(
                {
                    "chunk_id": c.chunk_id,
                    "document_id": c.doc_id,
                    "text": c.text,
                    "score": float(s),
                    "scores": stage[v],
                    "metadata": c.metadata,
                    "title": c.title,
                    "start": c.start,
                    "end": c.end,
                }
            )
        return out

    def stats(self) -> dict[str, Any]:
        self.refresh()
        docs, chunks = self.store.counts()
        with self._lock:
            dense, sparse = len(self.dense), self.sparse.n_live
        return {
            "documents": docs,
            "chunks": chunks,
            "index_type": self.dense.kind,
            "indexed": {"dense": dense, "sparse": sparse},
        }

    def close(self, checkpoint: bool = True) -> None:
        if checkpoint:
            try:
                self.checkpoint()
            except OSError as exc:
                log.warning("collection %s: checkpoint on close failed: %s", self.config.name, exc)
        self.store.close()
