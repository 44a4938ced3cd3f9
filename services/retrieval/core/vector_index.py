"""Dense indexes over FAISS, keyed by chunk vid so that deletes and replacements work.

* ``flat``: ``IndexIDMap2(IndexFlatIP)``: exact inner product (= cosine, vectors are
  normalised); the right choice up to tens of thousands of chunks.
* ``ivf``: ``IndexIVFFlat`` (inner product), trained on the vectors present when it is
  created; FAISS keeps ids and removes by id natively. While a collection is below
  ``IVF_MIN_TRAIN`` vectors a pinned ``ivf`` stays exact (IVF cannot be trained on a handful).
* ``hnsw``: ``IndexIDMap2(IndexHNSWFlat)``. HNSW graphs cannot drop nodes, so deletes are
  tombstones excluded at search time by an ``IDSelector``; the graph is rebuilt without
  them once they pass a fifth of it.
* ``auto``: ``flat`` until ``ivf_threshold`` vectors, then ``ivf``.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any, Protocol

import faiss
import numpy as np

_faiss: Any = faiss  # the SWIG stubs lack the SearchParameters* keyword constructors

IVF_MIN_TRAIN = 1000


class VectorIndex(Protocol):
    dim: int

    @property
    def kind(self) -> str: ...

    def __len__(self) -> int: ...

    def add(self, vids: np.ndarray, vectors: np.ndarray) -> None: ...

    def remove(self, vids: np.ndarray) -> None: ...

    def search(
        self, query: np.ndarray, k: int, allowed: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]: ...

    def to_bytes(self) -> bytes: ...


@dataclass(frozen=True)
class IndexParams:
    kind: str = "auto"  # auto | flat | ivf | hnsw
    ivf_threshold: int = 50_000
    ivf_nprobe: int = 16
    hnsw_m: int = 32
    hnsw_ef_search: int = 128


def _empty() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)


class FaissIndex:
    """``VectorIndex`` over FAISS. Callers serialise writes against searches."""

    def __init__(self, dim: int, params: IndexParams) -> None:
        self.dim = dim
        self.params = params
        self.deleted: set[int] = set()
        self._index: Any = self._new(params.kind if params.kind == "hnsw" else "flat")
        self._kind = "hnsw" if params.kind == "hnsw" else "flat"

    def _new(self, kind: str, n_hint: int = 0) -> Any:
        if kind == "flat":
            return faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))
        if kind == "hnsw":
            inner = faiss.IndexHNSWFlat(self.dim, self.params.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            inner.hnsw.efConstruction = 80
            inner.hnsw.efSearch = self.params.hnsw_ef_search
            return faiss.IndexIDMap2(inner)
        nlist = max(8, min(int(4 * math.sqrt(max(n_hint, 1))), n_hint // 39))
        quantizer = faiss.IndexFlatIP(self.dim)
        index = faiss.IndexIVFFlat(quantizer, self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.nprobe = self.params.ivf_nprobe
        return index

    @property
    def kind(self) -> str:
        return self._kind

    def __len__(self) -> int:
        return int(self._index.ntotal) - len(self.deleted)

    def _all_vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, vectors) currently stored, tombstones excluded (flat and hnsw only)."""
        ids = faiss.vector_to_array(self._index.id_map).astype(np.int64)
        vecs = self._index.index.reconstruct_n(0, self._index.ntotal) if len(ids) else np.zeros((0, self.dim))
        if self.deleted:
            keep = ~np.isin(ids, np.fromiter(self.deleted, dtype=np.int64))
            ids, vecs = ids[keep], vecs[keep]
        return ids, np.ascontiguousarray(vecs, dtype=np.float32)

    def _maybe_grow(self) -> None:
        """Switch a growing flat index to IVF (``auto`` past the threshold; pinned ``ivf`` as
        soon as there is enough to train on)."""
        if self._kind != "flat":
            return
        target = self.params.kind
        n = int(self._index.ntotal)
        if (target == "auto" and n >= self.params.ivf_threshold) or (target == "ivf" and n >= IVF_MIN_TRAIN):
            ids, vecs = self._all_vectors()
            ivf = self._new("ivf", n_hint=len(ids))
            ivf.train(vecs)
            ivf.add_with_ids(vecs, ids)
            self._index, self._kind = ivf, "ivf"

    def add(self, vids: np.ndarray, vectors: np.ndarray) -> None:
        if not len(vids):
            return
        vecs = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        ids = np.ascontiguousarray(vids, dtype=np.int64)
        self._index.add_with_ids(vecs, ids)
        self._maybe_grow()

    def remove(self, vids: np.ndarray) -> None:
        if not len(vids):
            return
        ids = np.ascontiguousarray(vids, dtype=np.int64)
        if self._kind == "hnsw":
            self.deleted.update(int(v) for v in ids)
            if len(self.deleted) > 0.2 * max(int(self._index.ntotal), 1):
                keep_ids, vecs = self._all_vectors()
                self._index = self._new("hnsw")
                self.deleted = set()
                if len(keep_ids):
                    self._index.add_with_ids(vecs, keep_ids)
            return
        self._index.remove_ids(faiss.IDSelectorBatch(ids))

    def search(
        self, query: np.ndarray, k: int, allowed: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        if self._index.ntotal == 0 or k <= 0:
            return _empty()
        q = np.ascontiguousarray(query, dtype=np.float32).reshape(1, self.dim)
        selectors: list[Any] = []
        keep_alive: list[Any] = []  # FAISS selectors do not own what they point at
        if allowed is not None:
            if not len(allowed):
                return _empty()
            arr = np.ascontiguousarray(allowed, dtype=np.int64)
            keep_alive.append(arr)
            selectors.append(faiss.IDSelectorBatch(arr))
        if self.deleted:
            arr = np.fromiter(self.deleted, dtype=np.int64)
            keep_alive.append(arr)
            inner = faiss.IDSelectorBatch(arr)
            keep_alive.append(inner)
            selectors.append(faiss.IDSelectorNot(inner))
        params: Any = None
        if selectors:
            sel = selectors[0]
            for other in selectors[1:]:
                keep_alive.append(sel)
                sel = faiss.IDSelectorAnd(sel, other)
            keep_alive.extend(selectors)
            if self._kind == "ivf":
                params = _faiss.SearchParametersIVF(sel=sel, nprobe=self.params.ivf_nprobe)
            elif self._kind == "hnsw":
                params = _faiss.SearchParametersHNSW(sel=sel, efSearch=max(self.params.hnsw_ef_search, k))
            else:
                params = _faiss.SearchParameters(sel=sel)
        elif self._kind == "hnsw":
            params = _faiss.SearchParametersHNSW(efSearch=max(self.params.hnsw_ef_search, k))
        kk = min(k, int(self._index.ntotal))
        scores, ids = (
            self._index.search(q, kk, params=params) if params is not None else self._index.search(q, kk)
        )
        mask = ids[0] >= 0
        return ids[0][mask].astype(np.int64), scores[0][mask].astype(np.float32)

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        np.savez(
            buf,
            faiss=faiss.serialize_index(self._index),
            kind=np.array([self._kind]),
            deleted=np.fromiter(self.deleted, dtype=np.int64, count=len(self.deleted)),
        )
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, raw: bytes, dim: int, params: IndexParams) -> FaissIndex:
        z = np.load(io.BytesIO(raw), allow_pickle=False)
        self = cls(dim, params)
        self._index = faiss.deserialize_index(z["faiss"])
        self._kind = str(z["kind"][0])
        self.deleted = {int(v) for v in z["deleted"]}
        if self._kind == "ivf":
            self._index.nprobe = params.ivf_nprobe
        if self._index.d != dim:
            raise ValueError(f"checkpoint has dimension {self._index.d}, collection has {dim}")
        return self
