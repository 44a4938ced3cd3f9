"""The Milvus backend: collections in a Milvus server, so retrieval replicas are stateless.

Mapping. Each Tandem collection is two Milvus collections (chunks and documents, see
``store.py``) named ``tandem_<hash of tenant and name>``; their settings are rows of one
``tandem_collections`` collection, keyed ``<tenant>/<name>``, which is also how a tenant's
collections are listed. Tenants are not Milvus databases: Milvus caps databases at 64 per
cluster by default and Milvus Lite implements none. Collections are not partitions of a
shared collection: each has its own vector dimension (embedding model), BM25 analyzer and
index type, which a partition cannot vary, and dropping a collection is then one drop.

Search. Dense (inner product on normalised vectors, i.e. cosine), sparse (Milvus's BM25
function over ``index_text``, with TANDEM_RETRIEVAL_BM25_K1/B), and hybrid: one
``hybrid_search`` of both with Milvus's ``RRFRanker(TANDEM_RETRIEVAL_RRF_K)``. Milvus's RRF has
no per-ranking weights, so a hybrid search whose dense and sparse weights differ runs the two
searches and fuses them here with the same formula. Filters become Milvus expressions
(``expr.py``). Hybrid hits carry only the fused score in ``scores``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
from pymilvus import AnnSearchRequest, DataType, MilvusClient, RRFRanker

from services.common.config import SettingsError
from services.retrieval.config import RetrievalSettings
from services.retrieval.core.backend import (
    exists_error,
    local_collections,
    not_found,
    record_backend,
    wrong_backend,
)
from services.retrieval.core.collection import (
    CandidateIndex,
    ChunkedCollection,
    CollectionConfig,
    CollectionParts,
    Ranked,
)
from services.retrieval.core.filters import Filter
from services.retrieval.core.fusion import rrf
from services.retrieval.milvus.expr import string_literal, to_expr
from services.retrieval.milvus.store import (
    INDEX_TYPES,
    MilvusChunkStore,
    create_collections,
    drop_collections,
    stored_chunk,
)

log = logging.getLogger("tandem.retrieval")
META = "tandem_collections"


def prefix_of(tenant: str, name: str) -> str:
    return "tandem_" + hashlib.sha256(f"{tenant}\x00{name}".encode()).hexdigest()[:24]


class MilvusCollection(ChunkedCollection):
    def __init__(self, parts: CollectionParts, client: MilvusClient, prefix: str) -> None:
        self.milvus = MilvusChunkStore(client, prefix)
        super().__init__(parts, self.milvus)
        self.client = client

    def _search(
        self, data: list[Any], field: str, metric: str, limit: int, expr: str
    ) -> list[dict[str, Any]]:
        res = self.client.search(
            self.milvus.chunks,
            data=data,
            anns_field=field,
            limit=limit,
            filter=expr,
            search_params={"metric_type": metric},
            output_fields=self.milvus.hit_fields,
        )
        return list(res[0])

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
        # index versions (and so candidates) are the embedded backend's: versions() is a 501 here
        assert candidate is None
        expr = to_expr(where) if where is not None else ""
        dense_w, sparse_w = weights.get("dense", 1.0), weights.get("sparse", 1.0)
        if mode == "hybrid" and dense_w == sparse_w and dense_w > 0:
            qv = self.embedder.embed_query(query).astype(np.float32).tolist()
            reqs = [
                AnnSearchRequest([qv], "dense", {"metric_type": "IP"}, depth, expr=expr or None),
                AnnSearchRequest([query], "sparse", {"metric_type": "BM25"}, depth, expr=expr or None),
            ]
            res = self.client.hybrid_search(
                self.milvus.chunks,
                reqs,
                RRFRanker(self.options.rrf_k),
                limit=want,
                output_fields=self.milvus.hit_fields,
            )
            hits = [(stored_chunk(h["entity"]), float(h["distance"]) * dense_w) for h in res[0]]
            return Ranked(hits, {c.chunk_id: {"hybrid": s} for c, s in hits})
        lists: dict[str, list[dict[str, Any]]] = {}
        if mode in ("dense", "hybrid") and (mode == "dense" or dense_w > 0):
            qv = self.embedder.embed_query(query).astype(np.float32).tolist()
            lists["dense"] = self._search([qv], "dense", "IP", depth, expr)
        if mode in ("sparse", "hybrid") and (mode == "sparse" or sparse_w > 0):
            lists["sparse"] = self._search([query], "sparse", "BM25", depth, expr)
        chunks = {h["entity"]["chunk_id"]: stored_chunk(h["entity"]) for hs in lists.values() for h in hs}
        stages: dict[str, dict[str, float]] = {}
        for name, hs in lists.items():
            for h in hs:
                stages.setdefault(h["entity"]["chunk_id"], {})[name] = float(h["distance"])
        if mode != "hybrid":
            ranked = [(h["entity"]["chunk_id"], float(h["distance"])) for h in lists[mode]]
        else:
            # Unequal weights: RRF with weights, here (Milvus's RRFRanker has none).
            ids = {c: i for i, c in enumerate(chunks)}
            order = {
                n: np.array([ids[h["entity"]["chunk_id"]] for h in hs], dtype=np.int64)
                for n, hs in lists.items()
            }
            names = list(chunks)
            ranked = [(names[i], s) for i, s in rrf(order, weights, self.options.rrf_k)]
            for cid, s in ranked:
                stages[cid]["hybrid"] = s
        ranked = ranked[:want]
        return Ranked([(chunks[c], s) for c, s in ranked], stages)

    def stats(self) -> dict[str, Any]:
        docs, chunks = self.milvus.counts()
        return {
            "documents": docs,
            "chunks": chunks,
            "index_type": "milvus-" + INDEX_TYPES.get(self.config.index, "FLAT").lower(),
            "indexed": {"dense": chunks, "sparse": chunks},
        }

    def close(self, checkpoint: bool = True) -> None:
        pass  # nothing local to save: Milvus persists every write


class MilvusBackend:
    name = "milvus"

    def __init__(self, settings: RetrievalSettings, base: Path) -> None:
        self.settings = settings
        self.base = base
        self._client: MilvusClient | None = None
        self._lock = threading.Lock()

    @property
    def client(self) -> MilvusClient:
        if self._client is None:
            self.check()
        assert self._client is not None
        return self._client

    def check(self) -> None:
        embedded = local_collections(self.base)
        if embedded:
            raise SettingsError(
                f"TANDEM_RETRIEVAL_BACKEND=milvus, but {self.base} holds collections of the embedded "
                f"backend ({', '.join(embedded[:5])}{', ...' if len(embedded) > 5 else ''}); set "
                "TANDEM_RETRIEVAL_BACKEND=embedded to serve them, or use another TANDEM_HOME"
            )
        uri = self.settings.milvus_uri
        if not uri.startswith(("http://", "https://", "tcp://", "unix:")):
            raise SettingsError(
                f"TANDEM_RETRIEVAL_MILVUS_URI={uri!r} is not a server address (http://host:port); "
                "start Milvus Lite with `python -m services.retrieval.milvus.lite FILE.db --port N`"
            )
        try:
            client = MilvusClient(
                uri=uri, token=self.settings.milvus_token, timeout=self.settings.milvus_timeout
            )
            client.list_collections()
        except Exception as exc:
            raise SettingsError(
                f"TANDEM_RETRIEVAL_MILVUS_URI={uri!r}: cannot reach Milvus within "
                f"{self.settings.milvus_timeout:.0f}s (TANDEM_RETRIEVAL_MILVUS_TIMEOUT): {type(exc).__name__}: {exc}"
            ) from None
        if not client.has_collection(META):
            s = client.create_schema(auto_id=False, enable_dynamic_field=False)
            s.add_field("key", DataType.VARCHAR, is_primary=True, max_length=1024)
            s.add_field("tenant", DataType.VARCHAR, max_length=1024)
            s.add_field("config", DataType.VARCHAR, max_length=8192)
            s.add_field("unused", DataType.FLOAT_VECTOR, dim=2)
            ip = client.prepare_index_params()
            ip.add_index("unused", index_type="FLAT", metric_type="L2")
            client.create_collection(META, schema=s, index_params=ip, consistency_level="Strong")
        self._client = client

    @staticmethod
    def _key(tenant: str, name: str) -> str:
        return f"{tenant}/{name}"

    def _row(self, tenant: str, config: CollectionConfig) -> dict[str, Any]:
        """The settings row of a collection in ``META``."""
        return {
            "key": self._key(tenant, config.name),
            "tenant": tenant,
            "config": config.to_json().decode(),
            "unused": [0.0, 0.0],
        }

    def _get(self, tenant: str, name: str) -> CollectionConfig | None:
        rows = self.client.get(META, ids=[self._key(tenant, name)], output_fields=["config"])
        return CollectionConfig.from_json(rows[0]["config"].encode()) if rows else None

    def create(self, tenant: str, config: CollectionConfig) -> None:
        with self._lock:
            if self._get(tenant, config.name) is not None:
                raise exists_error(config.name)
            record_backend(self.base, self.name)
            prefix = prefix_of(tenant, config.name)
            s = self.settings
            drop_collections(self.client, prefix)  # leftovers of a create that died half-way
            create_collections(
                self.client, prefix, config.dim, s.bm25_language, config.index, s.bm25_k1, s.bm25_b
            )
            # The settings row last: a collection exists once both its Milvus collections do.
            self.client.insert(META, [self._row(tenant, config)])

    def load_config(self, tenant: str, name: str) -> CollectionConfig:
        config = self._get(tenant, name)
        if config is None:
            if (self.base / tenant / name / "collection.json").exists():
                raise wrong_backend(name, tenant, "embedded", self.name)
            raise not_found(name)
        return config

    def save_config(self, tenant: str, config: CollectionConfig) -> None:
        with self._lock:
            if self._get(tenant, config.name) is None:
                raise not_found(config.name)
            self.client.upsert(META, [self._row(tenant, config)])

    def list_configs(self, tenant: str) -> list[CollectionConfig]:
        rows = self.client.query(META, filter=f"tenant == {string_literal(tenant)}", output_fields=["config"])
        configs = [CollectionConfig.from_json(r["config"].encode()) for r in rows]
        return sorted(configs, key=lambda c: c.name)

    def exists(self, tenant: str, name: str) -> bool:
        return self._get(tenant, name) is not None

    def open(self, tenant: str, parts: CollectionParts) -> ChunkedCollection:
        return MilvusCollection(parts, self.client, prefix_of(tenant, parts.config.name))

    def delete(self, tenant: str, name: str) -> None:
        # The settings row first: the collection is gone for every replica at once.
        self.client.delete(META, ids=[self._key(tenant, name)])
        drop_collections(self.client, prefix_of(tenant, name))

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
