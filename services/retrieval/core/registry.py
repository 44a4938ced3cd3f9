"""Collections per tenant under ``$TANDEM_HOME/retrieval/<tenant>/<collection>/``.

Each collection folder holds ``collection.json`` (its settings), ``chunks.sqlite3`` (the
store and op log), ``index/`` (checkpoints) and ``uploads/`` (files waiting for a job).
A collection is created in a hidden temp folder and renamed into place, so a crash never
leaves a half-made one; deletion renames it away first for the same reason. Another
tenant's collection is simply not in the caller's folder: a 404.
"""

from __future__ import annotations

import re
import shutil
import threading
import time
import uuid
from pathlib import Path

from services.common.embedding_models import resolve_model_path
from services.common.errors import Conflict, InvalidRequest, NotFound
from services.retrieval.config import RetrievalSettings
from services.retrieval.core.atomic import atomic_write, fsync_dir
from services.retrieval.core.collection import Collection, CollectionConfig, SearchOptions
from services.retrieval.core.embedder import Embedder, get_embedder, get_http_embedder
from services.retrieval.core.reranker import Reranker, get_http_reranker, get_reranker
from services.retrieval.core.vector_index import IndexParams

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def validate_name(name: str) -> str:
    if not NAME_RE.match(name) or name.endswith("."):
        raise InvalidRequest(
            f"invalid collection name {name!r}: use 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit",
            param="name",
        )
    return name


# ``CollectionConfig.model_path`` of a collection embedded by TANDEM_RETRIEVAL_EMBEDDER_URL.
REMOTE_MODEL = "remote:"


class CollectionManager:
    def __init__(
        self, home: Path, settings: RetrievalSettings, model_roots: list[Path], service_api_key: str = ""
    ) -> None:
        self.base = home / "retrieval"
        self.settings = settings
        self.model_roots = model_roots
        self.service_api_key = service_api_key
        self._open: dict[tuple[str, str], Collection] = {}
        self._lock = threading.Lock()

    def options(self, index: str) -> SearchOptions:
        s = self.settings
        return SearchOptions(
            index=IndexParams(index, s.ivf_threshold, s.ivf_nprobe, s.hnsw_m, s.hnsw_ef_search),
            k1=s.bm25_k1,
            b=s.bm25_b,
            language=s.bm25_language,
            rrf_k=s.rrf_k,
            dense_weight=s.hybrid_dense_weight,
            sparse_weight=s.hybrid_sparse_weight,
            hybrid_depth=s.hybrid_depth,
            rerank_depth=s.rerank_depth,
            checkpoint_every=s.checkpoint_every,
        )

    def tenant_dir(self, tenant: str) -> Path:
        return self.base / tenant

    def path_of(self, tenant: str, name: str) -> Path:
        return self.tenant_dir(tenant) / validate_name(name)

    def model_path(self, name: str) -> Path:
        return resolve_model_path(name, self.model_roots)

    def embedder_for(self, model_path: Path):  # type: ignore[no-untyped-def]
        return get_embedder(
            model_path,
            batch_size=self.settings.embedding_batch_size,
            dtype=self.settings.embedding_dtype,
            workers=self.settings.embedding_workers,
        )

    def embedder_named(self, model: str, model_path: str | None = None) -> tuple[Embedder, str]:
        """The embedder of ``model`` (a collection's ``embedding_model``) and the path to record:
        the embedding server's when TANDEM_RETRIEVAL_EMBEDDER_URL is set, else the local model."""
        s = self.settings
        if s.embedder_url:
            key = s.embedder_api_key or self.service_api_key
            emb = get_http_embedder(
                s.embedder_url, key, model, batch_size=s.embedding_batch_size, timeout=s.embedder_timeout
            )
            return emb, REMOTE_MODEL + model
        if model_path and not model_path.startswith(REMOTE_MODEL):
            path = Path(model_path)
        else:
            path = self.model_path(model)
        return self.embedder_for(path), str(path)

    def reranker(self) -> Reranker | None:
        if not self.settings.reranker_model:
            return None
        s = self.settings
        if s.reranker_url:
            key = s.embedder_api_key or self.service_api_key
            return get_http_reranker(s.reranker_url, key, s.reranker_model, timeout=s.embedder_timeout)
        path = resolve_model_path(self.settings.reranker_model, self.model_roots, param="reranker_model")
        return get_reranker(path)

    def create(
        self,
        tenant: str,
        name: str,
        *,
        embedding_model: str | None = None,
        chunk_size: int | None = None,
        chunk_overlap: int | None = None,
        index: str | None = None,
    ) -> CollectionConfig:
        final = self.path_of(tenant, name)
        if final.exists():
            raise Conflict(f"collection {name!r} already exists", param="name", code="collection_exists")
        model = embedding_model or self.settings.embedding_model
        embedder, model_path = self.embedder_named(model)
        size = chunk_size or self.settings.chunk_size
        overlap = self.settings.chunk_overlap if chunk_overlap is None else chunk_overlap
        if overlap >= size:
            raise InvalidRequest(
                f"chunking.overlap ({overlap}) must be smaller than chunking.size ({size})",
                param="chunking.overlap",
            )
        config = CollectionConfig(
            name=name,
            embedding_model=model,
            model_path=model_path,
            dim=embedder.dim,
            chunk_size=size,
            chunk_overlap=overlap,
            index=index or self.settings.index,
            created_at=time.time(),
        )
        tenant_dir = self.tenant_dir(tenant)
        tenant_dir.mkdir(parents=True, exist_ok=True)
        tmp = tenant_dir / f".creating-{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        atomic_write(tmp / "collection.json", config.to_json())
        try:
            tmp.rename(final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise Conflict(
                f"collection {name!r} already exists", param="name", code="collection_exists"
            ) from None
        fsync_dir(tenant_dir)
        return config

    def config(self, tenant: str, name: str) -> CollectionConfig:
        path = self.path_of(tenant, name) / "collection.json"
        try:
            return CollectionConfig.from_json(path.read_bytes())
        except FileNotFoundError:
            raise NotFound(
                f"collection {name!r} not found", param="name", code="collection_not_found"
            ) from None

    def list(self, tenant: str) -> list[CollectionConfig]:
        out = []
        d = self.tenant_dir(tenant)
        if d.is_dir():
            for child in sorted(d.iterdir()):
                if child.name.startswith(".") or not (child / "collection.json").exists():
                    continue
                out.append(CollectionConfig.from_json((child / "collection.json").read_bytes()))
        return out

    def get(self, tenant: str, name: str) -> Collection:
        key = (tenant, name)
        with self._lock:
            col = self._open.get(key)
            if col is not None and (col.root / "collection.json").exists():
                return col
            if col is not None:  # deleted by another process
                self._open.pop(key).close(checkpoint=False)
            config = self.config(tenant, name)
            embedder, _ = self.embedder_named(config.embedding_model, config.model_path)
            if embedder.dim != config.dim:
                # Another model now answers to this name (here or on the embedding server):
                # its vectors would not fit the collection's index.
                raise Conflict(
                    f"collection {name!r} holds {config.dim}-dimensional vectors of "
                    f"{config.embedding_model!r}, but that model now gives {embedder.dim}",
                    param="embedding_model",
                    code="embedding_dimension_mismatch",
                )
            col = Collection(
                self.path_of(tenant, name),
                config,
                embedder,
                self.options(config.index),
                self.reranker(),
            )
            self._open[key] = col
            return col

    def delete(self, tenant: str, name: str) -> None:
        path = self.path_of(tenant, name)
        self.config(tenant, name)  # 404 if missing
        with self._lock:
            col = self._open.pop((tenant, name), None)
        if col is not None:
            col.close(checkpoint=False)
        trash = path.parent / f".deleted-{name}-{uuid.uuid4().hex[:8]}"
        try:
            path.rename(trash)
        except FileNotFoundError:
            raise NotFound(f"collection {name!r} not found", param="name") from None
        fsync_dir(path.parent)
        shutil.rmtree(trash, ignore_errors=True)

    def close_all(self) -> None:
        with self._lock:
            cols = list(self._open.values())
            self._open.clear()
        for col in cols:
            col.close()
