"""One collection's documents and chunks in two Milvus collections.

* ``<prefix>_chunks``: one row per chunk, keyed by its content-derived ``chunk_id``, with the
  document's id, title and metadata (so a search needs no second lookup), the dense vector,
  ``index_text`` (context + text) from which Milvus's own BM25 function derives the
  sparse vector, and ``structure`` (section, pages, anchor: core/structure.py; collections
  created before that field have none, and their chunks no structure).
* ``<prefix>_docs``: the documents, keyed ``<doc_id>#<part>``: Milvus strings are at most
  65,535 bytes, so a long text is stored in parts (part 0 also holds title and metadata).

Documents are found by ``doc_key`` (a hash of the id), never by the id itself: ids may hold
characters a Milvus expression cannot carry. There are no transactions in Milvus: a write
adds the new chunks, then removes the replaced ones, then writes the document, so a crash
half-way leaves at worst both versions' chunks, which re-sending the document repairs (chunk
ids are content-derived and the write is idempotent). Reads use Strong consistency, so a
write acknowledged by one replica is seen by the next search on any replica.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from pymilvus import DataType, Function, FunctionType, MilvusClient

from services.retrieval.core.store import DocumentRecord, MissingEmbeddings, StoredChunk, WriteResult
from services.retrieval.milvus.expr import string_literal
from services.retrieval.protocol import ChunkSpan, Document, located

MAX_VARCHAR = 65_535
QUERY_WINDOW = 16_384
PART_CHARS = 16_000  # at most 4 UTF-8 bytes a character: a part always fits in MAX_VARCHAR bytes
CONSISTENCY = "Strong"
HIT_FIELDS = ["chunk_id", "doc_id", "start", "end", "text", "title", "metadata"]
STRUCTURE = "structure"
INDEX_TYPES = {"auto": "FLAT", "flat": "FLAT", "hnsw": "HNSW", "ivf": "IVF_FLAT"}


def doc_key(doc_id: str) -> str:
    return hashlib.sha256(doc_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _keys_expr(field: str, keys: Iterable[str]) -> str:
    return f"{field} in [{', '.join(string_literal(k) for k in keys)}]"


def chunk_schema(client: MilvusClient, dim: int, language: str) -> Any:
    s = client.create_schema(auto_id=False, enable_dynamic_field=False)
    s.add_field("chunk_id", DataType.VARCHAR, is_primary=True, max_length=256)
    s.add_field("doc_key", DataType.VARCHAR, max_length=64)
    s.add_field("doc_id", DataType.VARCHAR, max_length=4096)
    s.add_field("ord", DataType.INT64)
    s.add_field("start", DataType.INT64)
    s.add_field("end", DataType.INT64)
    s.add_field("text", DataType.VARCHAR, max_length=MAX_VARCHAR)
    # english: stemming and stopwords like the embedded BM25; anything else: no stemming
    analyzer = {"type": "english"} if language == "english" else {"type": "standard"}
    s.add_field(
        "index_text", DataType.VARCHAR, max_length=MAX_VARCHAR, enable_analyzer=True, analyzer_params=analyzer
    )
    s.add_field("title", DataType.VARCHAR, max_length=8192)
    s.add_field("metadata", DataType.JSON)
    s.add_field(STRUCTURE, DataType.JSON)
    s.add_field("dense", DataType.FLOAT_VECTOR, dim=dim)
    s.add_field("sparse", DataType.SPARSE_FLOAT_VECTOR)
    s.add_function(
        Function(
            name="bm25",
            function_type=FunctionType.BM25,
            input_field_names=["index_text"],
            output_field_names=["sparse"],
        )
    )
    return s


def doc_schema(client: MilvusClient) -> Any:
    s = client.create_schema(auto_id=False, enable_dynamic_field=False)
    s.add_field("part_key", DataType.VARCHAR, is_primary=True, max_length=256)
    s.add_field("doc_key", DataType.VARCHAR, max_length=64)
    s.add_field("doc_id", DataType.VARCHAR, max_length=4096)
    s.add_field("part", DataType.INT64)
    s.add_field("text", DataType.VARCHAR, max_length=MAX_VARCHAR)
    s.add_field("title", DataType.VARCHAR, max_length=8192)
    s.add_field("metadata", DataType.JSON)
    s.add_field("content_hash", DataType.VARCHAR, max_length=128)
    s.add_field("n_chunks", DataType.INT64)
    s.add_field("created_at", DataType.DOUBLE)
    s.add_field("updated_at", DataType.DOUBLE)
    s.add_field("unused", DataType.FLOAT_VECTOR, dim=2)  # Milvus wants a vector field in every collection
    return s


def create_collections(
    client: MilvusClient, prefix: str, dim: int, language: str, index: str, k1: float, b: float
) -> None:
    ip = client.prepare_index_params()
    ip.add_index("dense", index_type=INDEX_TYPES.get(index, "FLAT"), metric_type="IP")
    ip.add_index(
        "sparse", index_type="SPARSE_INVERTED_INDEX", metric_type="BM25", params={"bm25_k1": k1, "bm25_b": b}
    )
    client.create_collection(
        f"{prefix}_chunks",
        schema=chunk_schema(client, dim, language),
        index_params=ip,
        consistency_level=CONSISTENCY,
    )
    dp = client.prepare_index_params()
    dp.add_index("unused", index_type="FLAT", metric_type="L2")
    client.create_collection(
        f"{prefix}_docs", schema=doc_schema(client), index_params=dp, consistency_level=CONSISTENCY
    )


def drop_collections(client: MilvusClient, prefix: str) -> None:
    for suffix in ("_chunks", "_docs"):
        if client.has_collection(prefix + suffix):
            client.drop_collection(prefix + suffix)


def stored_chunk(row: dict[str, Any]) -> StoredChunk:
    return StoredChunk(
        vid=0,
        chunk_id=row["chunk_id"],
        doc_id=row["doc_id"],
        start=int(row["start"]),
        end=int(row["end"]),
        text=row["text"],
        metadata=dict(row["metadata"] or {}),
        title=row["title"],
        structure=dict(row.get(STRUCTURE) or {}),
    )


class MilvusChunkStore:
    """``ChunkStore`` over a Milvus server (see the module's docstring)."""

    def __init__(self, client: MilvusClient, prefix: str) -> None:
        self.client = client
        self.chunks = f"{prefix}_chunks"
        self.docs = f"{prefix}_docs"
        fields = {f["name"] for f in client.describe_collection(self.chunks).get("fields", [])}
        self.has_structure = STRUCTURE in fields
        # What a search reads of a chunk.
        self.hit_fields = [*HIT_FIELDS, STRUCTURE] if self.has_structure else list(HIT_FIELDS)

    def _query(self, collection: str, expr: str, fields: list[str]) -> list[dict[str, Any]]:
        """Every row matching ``expr``. One query returns at most 16,384 rows (Milvus's query
        window); past that, an iterator pages through the rest."""
        rows = self.client.query(collection, filter=expr, output_fields=fields, limit=QUERY_WINDOW)
        if len(rows) < QUERY_WINDOW:
            return list(rows)
        it = self.client.query_iterator(collection, batch_size=4096, filter=expr, output_fields=fields)
        out: list[dict[str, Any]] = []
        try:
            while batch := it.next():
                out.extend(batch)
        finally:
            it.close()
        return out

    def existing_chunk_ids(self, chunk_ids: Iterable[str]) -> set[str]:
        ids = list(chunk_ids)
        found: set[str] = set()
        for i in range(0, len(ids), 1000):
            rows = self.client.get(self.chunks, ids=ids[i : i + 1000], output_fields=["chunk_id"])
            found.update(r["chunk_id"] for r in rows)
        return found

    def _doc_chunks(self, keys: list[str]) -> dict[str, dict[str, int]]:
        """doc_key -> {chunk_id: ord} of the stored chunks of those documents."""
        out: dict[str, dict[str, int]] = {k: {} for k in keys}
        for i in range(0, len(keys), 500):
            for r in self._query(
                self.chunks, _keys_expr("doc_key", keys[i : i + 500]), ["chunk_id", "doc_key", "ord"]
            ):
                out[r["doc_key"]][r["chunk_id"]] = int(r["ord"])
        return out

    def _doc_parts(self, keys: list[str]) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {k: [] for k in keys}
        fields = ["part_key", "doc_key", "part", "created_at", "title", "metadata"]
        for i in range(0, len(keys), 500):
            for r in self._query(self.docs, _keys_expr("doc_key", keys[i : i + 500]), fields):
                out[r["doc_key"]].append(r)
        return out

    def write(self, docs: Sequence[DocumentRecord], embeddings: dict[str, np.ndarray]) -> WriteResult:
        keys = [doc_key(d.doc_id) for d in docs]
        old = self._doc_chunks(keys)
        missing = {
            c.chunk_id
            for d, k in zip(docs, keys, strict=True)
            for c in d.chunks
            if c.chunk_id not in old[k] and c.chunk_id not in embeddings
        }
        if missing:
            raise MissingEmbeddings(missing)
        parts = self._doc_parts(keys)
        now = time.time()
        added = removed = unchanged = 0
        new_rows: list[dict[str, Any]] = []
        gone: list[str] = []
        doc_rows: list[dict[str, Any]] = []
        stale_parts: list[str] = []
        for d, k in zip(docs, keys, strict=True):
            new_ids = {c.chunk_id for c in d.chunks}
            for c in d.chunks:
                if c.chunk_id in old[k]:
                    unchanged += 1
                    continue
                added += 1
                located = {STRUCTURE: c.structure} if self.has_structure else {}
                new_rows.append(
                    {
                        **located,
                        "chunk_id": c.chunk_id,
                        "doc_key": k,
                        "doc_id": d.doc_id,
                        "ord": c.ord,
                        "start": c.start,
                        "end": c.end,
                        "text": c.text,
                        "index_text": c.index_text,
                        "title": d.title,
                        "metadata": d.metadata,
                        "dense": np.asarray(embeddings[c.chunk_id], dtype=np.float32).tolist(),
                    }
                )
            dropped = [cid for cid in old[k] if cid not in new_ids]
            removed += len(dropped)
            gone.extend(dropped)
            created = min((float(p["created_at"]) for p in parts[k]), default=now)
            pieces = [d.text[i : i + PART_CHARS] for i in range(0, len(d.text), PART_CHARS)] or [""]
            for n, piece in enumerate(pieces):
                doc_rows.append(
                    {
                        "part_key": f"{k}#{n:06d}",
                        "doc_key": k,
                        "doc_id": d.doc_id,
                        "part": n,
                        "text": piece,
                        "title": d.title if n == 0 else "",
                        "metadata": d.metadata if n == 0 else {},
                        "content_hash": d.content_hash,
                        "n_chunks": len(d.chunks),
                        "created_at": created,
                        "updated_at": now,
                        "unused": [0.0, 0.0],
                    }
                )
            stale_parts.extend(p["part_key"] for p in parts[k] if int(p["part"]) >= len(pieces))
        # Unchanged chunks keep the title and metadata they were stored with: refresh those.
        changed = [
            (d, k)
            for d, k in zip(docs, keys, strict=True)
            if any(
                int(p["part"]) == 0 and (p["title"], p["metadata"] or {}) != (d.title, d.metadata)
                for p in parts[k]
            )
        ]
        refreshed = self._refresh_unchanged(changed, old)
        for i in range(0, len(new_rows), 256):
            self.client.upsert(self.chunks, new_rows[i : i + 256])
        if refreshed:
            for i in range(0, len(refreshed), 256):
                self.client.upsert(self.chunks, refreshed[i : i + 256])
        if gone:
            self.client.delete(self.chunks, ids=gone)
        for i in range(0, len(doc_rows), 64):
            self.client.upsert(self.docs, doc_rows[i : i + 64])
        if stale_parts:
            self.client.delete(self.docs, ids=stale_parts)
        return WriteResult(added, removed, unchanged, 0)

    def _refresh_unchanged(
        self, changed: list[tuple[DocumentRecord, str]], old: dict[str, dict[str, int]]
    ) -> list[dict[str, Any]]:
        """Full rows of the kept chunks of documents whose title or metadata changed (chunks
        carry them, so that a search needs no second lookup)."""
        kept = [c.chunk_id for d, k in changed for c in d.chunks if c.chunk_id in old[k]]
        if not kept:
            return []
        by_chunk = {c.chunk_id: d for d, _ in changed for c in d.chunks}
        rows: list[dict[str, Any]] = []
        fields = [*self.hit_fields, "doc_key", "ord", "index_text", "dense"]
        for i in range(0, len(kept), 1000):
            for r in self.client.get(self.chunks, ids=kept[i : i + 1000], output_fields=fields):
                d = by_chunk[r["chunk_id"]]
                if r["title"] != d.title or (r["metadata"] or {}) != d.metadata:
                    row = {f: r[f] for f in fields}
                    row.update(title=d.title, metadata=d.metadata, dense=[float(x) for x in r["dense"]])
                    rows.append(row)
        return rows

    def delete_document(self, doc_id: str) -> bool:
        k = doc_key(doc_id)
        parts = self._doc_parts([k])[k]
        if not parts:
            return False
        chunks = list(self._doc_chunks([k])[k])
        if chunks:
            self.client.delete(self.chunks, ids=chunks)
        self.client.delete(self.docs, ids=[p["part_key"] for p in parts])
        return True

    @staticmethod
    def _document(row: dict[str, Any], text: str | None) -> Document:
        return Document(
            id=row["doc_id"],
            title=row["title"],
            metadata=dict(row["metadata"] or {}),
            chunks=int(row["n_chunks"]),
            created_at=float(row["created_at"]),
            updated_at=float(row["updated_at"]),
            text=text,
        )

    def get_document(self, doc_id: str) -> Document | None:
        k = doc_key(doc_id)
        fields = ["doc_id", "part", "text", "title", "metadata", "n_chunks", "created_at", "updated_at"]
        rows = sorted(
            self._query(self.docs, f"doc_key == {string_literal(k)}", fields), key=lambda r: r["part"]
        )
        if not rows:
            return None
        doc = self._document(rows[0], "".join(r["text"] for r in rows))
        spans = self._query(
            self.chunks,
            f"doc_key == {string_literal(k)}",
            ["chunk_id", "ord", "start", "end", "text", "index_text"]
            + ([STRUCTURE] if self.has_structure else []),
        )
        doc.chunk_list = [
            ChunkSpan(
                chunk_id=r["chunk_id"],
                start=int(r["start"]),
                end=int(r["end"]),
                # index_text is "<context>\n<text>" (or the text alone): the context is its head
                context=r["index_text"][: -len(r["text"]) - 1] if r["index_text"] != r["text"] else "",
                **located(dict(r.get(STRUCTURE) or {})),
            )
            for r in sorted(spans, key=lambda r: r["ord"])
        ]
        return doc

    def list_documents(self, limit: int, offset: int) -> tuple[list[Document], int]:
        # Milvus cannot order a query: read the (small) part-0 rows and page here.
        fields = ["doc_id", "title", "metadata", "n_chunks", "created_at", "updated_at"]
        rows = sorted(self._query(self.docs, "part == 0", fields), key=lambda r: r["doc_id"])
        return [self._document(r, None) for r in rows[offset : offset + limit]], len(rows)

    def _count(self, collection: str, expr: str) -> int:
        res = self.client.query(collection, filter=expr, output_fields=["count(*)"])
        return int(res[0]["count(*)"])

    def counts(self) -> tuple[int, int]:
        return self._count(self.docs, "part == 0"), self._count(self.chunks, "")

    def close(self) -> None:
        pass  # the client belongs to the backend
