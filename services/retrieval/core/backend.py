"""Where collections live: the backend protocol and the embedded backend.

A backend keeps collection settings, and builds the ``RetrievalCollection`` the API and the
worker use. ``EmbeddedBackend`` (the default) keeps each collection in a folder under
``$TANDEM_HOME/retrieval/<tenant>/<collection>/`` and injects a SQLite store and FAISS/BM25
indexes into ``Collection``; ``services/retrieval/milvus`` keeps them in a Milvus server.
``make_backend`` picks one from ``TANDEM_RETRIEVAL_BACKEND``.

A home used by one backend is refused by the other at start-up (``check``): the collections
would silently vanish otherwise. The folder records the backend holding its collections in
``$TANDEM_HOME/retrieval/BACKEND``.
"""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from services.common.atomic import atomic_write, fsync_path
from services.common.config import SettingsError
from services.common.errors import Conflict, NotFound
from services.retrieval.config import RetrievalSettings
from services.retrieval.core.collection import (
    ChunkedCollection,
    Collection,
    CollectionConfig,
    CollectionParts,
    SparseIndex,
)
from services.retrieval.core.sparse import Bm25Tokenizer, IncrementalBM25
from services.retrieval.core.store import SQLiteDocumentStore
from services.retrieval.core.vector_index import FaissIndex, IndexParams, VectorIndex

MARKER = "BACKEND"


class CollectionBackend(Protocol):
    name: str

    def check(self) -> None:
        """Start-up check; raises ``SettingsError`` naming the setting that is wrong."""
        ...

    def create(self, tenant: str, config: CollectionConfig) -> None:
        """Store a new collection's settings (409 if the name is taken)."""
        ...

    def load_config(self, tenant: str, name: str) -> CollectionConfig:
        """The settings of a collection (404 if there is none)."""
        ...

    def save_config(self, tenant: str, config: CollectionConfig) -> None:
        """Replace the stored settings of an existing collection (404 if there is none)."""
        ...

    def list_configs(self, tenant: str) -> list[CollectionConfig]: ...

    def exists(self, tenant: str, name: str) -> bool: ...

    def open(self, tenant: str, parts: CollectionParts) -> ChunkedCollection: ...

    def delete(self, tenant: str, name: str) -> None: ...

    def close(self) -> None: ...


def not_found(name: str) -> NotFound:
    return NotFound(f"collection {name!r} not found", param="name", code="collection_not_found")


def exists_error(name: str) -> Conflict:
    return Conflict(f"collection {name!r} already exists", param="name", code="collection_exists")


def recorded_backend(base: Path) -> str | None:
    try:
        return (base / MARKER).read_text().strip() or None
    except FileNotFoundError:
        return None


def record_backend(base: Path, name: str) -> None:
    if recorded_backend(base) != name:
        base.mkdir(parents=True, exist_ok=True)
        atomic_write(base / MARKER, name.encode())


def local_collections(base: Path) -> list[str]:
    """``tenant/collection`` of every embedded collection under ``base``."""
    return sorted(f"{p.parent.parent.name}/{p.parent.name}" for p in base.glob("*/*/collection.json"))


def wrong_backend(name: str, tenant: str, holder: str, configured: str) -> Conflict:
    return Conflict(
        f"collection {name!r} of tenant {tenant!r} was created with TANDEM_RETRIEVAL_BACKEND={holder}; "
        f"this service runs with TANDEM_RETRIEVAL_BACKEND={configured}",
        param="name",
        code="collection_on_other_backend",
    )


@dataclass(frozen=True)
class FaissBm25Indexes:
    """The embedded backend's ``IndexFactory``: FAISS for dense vectors, incremental BM25."""

    dim: int
    params: IndexParams
    tokenizer: Bm25Tokenizer
    k1: float
    b: float

    def dense(self) -> VectorIndex:
        return FaissIndex(self.dim, self.params)

    def sparse(self) -> SparseIndex:
        return IncrementalBM25(self.tokenizer, self.k1, self.b)

    def dense_from(self, raw: bytes) -> VectorIndex:
        return FaissIndex.from_bytes(raw, self.dim, self.params)

    def sparse_from(self, raw: bytes) -> SparseIndex:
        return IncrementalBM25.from_bytes(raw, self.tokenizer, self.k1, self.b)

    def for_dim(self, dim: int) -> FaissBm25Indexes:
        return dataclasses.replace(self, dim=dim)


class EmbeddedBackend:
    """Collections in folders: ``collection.json``, ``chunks.sqlite3`` and ``index/``. Created in
    a hidden temp folder and renamed into place, so a crash never leaves a half-made one;
    deleted by renaming away first for the same reason."""

    name = "embedded"

    def __init__(self, base: Path) -> None:
        self.base = base

    def check(self) -> None:
        holder = recorded_backend(self.base)
        if holder not in (None, self.name):
            raise SettingsError(
                f"TANDEM_RETRIEVAL_BACKEND=embedded, but the collections of {self.base} are on the "
                f"{holder} backend ({self.base / MARKER}); set TANDEM_RETRIEVAL_BACKEND={holder}"
            )

    def _dir(self, tenant: str, name: str) -> Path:
        return self.base / tenant / name

    def create(self, tenant: str, config: CollectionConfig) -> None:
        final = self._dir(tenant, config.name)
        if final.exists():
            raise exists_error(config.name)
        record_backend(self.base, self.name)
        tenant_dir = final.parent
        tenant_dir.mkdir(parents=True, exist_ok=True)
        tmp = tenant_dir / f".creating-{config.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        atomic_write(tmp / "collection.json", config.to_json())
        try:
            tmp.rename(final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise exists_error(config.name) from None
        fsync_path(tenant_dir)

    def load_config(self, tenant: str, name: str) -> CollectionConfig:
        try:
            config = CollectionConfig.from_json((self._dir(tenant, name) / "collection.json").read_bytes())
        except FileNotFoundError:
            raise not_found(name) from None
        if config.name != name:
            # another spelling of the name on a case-insensitive file system: not this collection
            # (its access list is kept under its own name)
            raise not_found(name)
        if config.backend != self.name:
            raise wrong_backend(name, tenant, config.backend, self.name)
        return config

    def save_config(self, tenant: str, config: CollectionConfig) -> None:
        path = self._dir(tenant, config.name) / "collection.json"
        if not path.exists():
            raise not_found(config.name)
        atomic_write(path, config.to_json())

    def list_configs(self, tenant: str) -> list[CollectionConfig]:
        out = []
        d = self.base / tenant
        if d.is_dir():
            for child in sorted(d.iterdir()):
                if child.name.startswith(".") or not (child / "collection.json").exists():
                    continue
                out.append(CollectionConfig.from_json((child / "collection.json").read_bytes()))
        return out

    def exists(self, tenant: str, name: str) -> bool:
        return (self._dir(tenant, name) / "collection.json").exists()

    def open(self, tenant: str, parts: CollectionParts) -> ChunkedCollection:
        o = parts.options
        indexes = FaissBm25Indexes(parts.config.dim, o.index, Bm25Tokenizer(o.language), o.k1, o.b)
        return Collection(parts, SQLiteDocumentStore(parts.root / "chunks.sqlite3"), indexes)

    def delete(self, tenant: str, name: str) -> None:
        path = self._dir(tenant, name)
        trash = path.parent / f".deleted-{name}-{uuid.uuid4().hex[:8]}"
        try:
            path.rename(trash)
        except FileNotFoundError:
            raise not_found(name) from None
        fsync_path(path.parent)
        shutil.rmtree(trash, ignore_errors=True)

    def close(self) -> None:
        pass


def make_backend(settings: RetrievalSettings, base: Path) -> CollectionBackend:
    """The backend ``TANDEM_RETRIEVAL_BACKEND`` names, checked (start-up fails on a bad one)."""
    backend: CollectionBackend
    if settings.backend == "milvus":
        from services.retrieval.milvus.backend import MilvusBackend

        backend = MilvusBackend(settings, base)
    else:
        backend = EmbeddedBackend(base)
    backend.check()
    return backend
