"""Collections per tenant: names, models and settings here; where they live is the
backend's business (``backend.py``).

Every collection has a local folder ``$TANDEM_HOME/retrieval/<tenant>/<collection>/``: the
embedded backend keeps everything in it, and on any backend ``uploads/`` holds files waiting
for an ingestion job. Another tenant's collection is simply not among the caller's: a 404.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from pathlib import Path

from services.common.embedders import find_embedder, is_embedder_name
from services.common.embedding_models import resolve_model_path
from services.common.errors import Conflict, InvalidRequest, NotFound
from services.retrieval.config import RetrievalSettings
from services.retrieval.core.backend import CollectionBackend, make_backend
from services.retrieval.core.collection import (
    ChunkedCollection,
    CollectionConfig,
    CollectionParts,
    SearchOptions,
)
from services.retrieval.core.embedder import Embedder, get_embedder, get_http_embedder
from services.retrieval.core.ocr import check_language
from services.retrieval.core.onnx_export import EmbeddingBackend, QuantConfig
from services.retrieval.core.reranker import Reranker, get_http_reranker, get_reranker
from services.retrieval.core.vector_index import IndexParams
from services.retrieval.core.versions import IndexVersion, check_dim

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
        self,
        home: Path,
        settings: RetrievalSettings,
        model_roots: list[Path],
        service_api_key: str = "",
        backend: CollectionBackend | None = None,
    ) -> None:
        self.home = home
        self.base = home / "retrieval"
        # ONNX exports of local models (written here, never next to an installed package).
        self.onnx_cache = home / "models" / "onnx"
        self.settings = settings
        self.model_roots = model_roots
        self.service_api_key = service_api_key
        self.backend = backend or make_backend(settings, self.base)
        self._open: dict[tuple[str, str], ChunkedCollection] = {}
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

    def embedder_for(self, model_path: Path, backend: EmbeddingBackend = "torch"):  # type: ignore[no-untyped-def]
        s = self.settings
        return get_embedder(
            model_path,
            batch_size=s.embedding_batch_size,
            dtype=s.embedding_dtype,
            workers=s.embedding_workers,
            backend=backend,
            cache_root=self.onnx_cache,
            quant=QuantConfig(
                per_channel=s.onnx_int8_per_channel, fp32_ffn_output=s.onnx_int8_fp32_ffn_output
            ),
        )

    def embedder_named(
        self, model: str, model_path: str | None = None, backend: EmbeddingBackend = "torch"
    ) -> tuple[Embedder, str]:
        """The embedder of ``model`` (a collection's ``embedding_model``) and the path to record:
        the embedding server's when TANDEM_RETRIEVAL_EMBEDDER_URL is set, else the local model
        run by ``backend`` (torch when the ONNX packages are missing: see ``embedding_backend``)."""
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
        return self.embedder_for(path, backend), str(path)

    def resolve_embedder(
        self, tenant: str, name: str, backend: EmbeddingBackend = "torch"
    ) -> tuple[Embedder, str]:
        """The embedder a client names (``PATCH /v1/collections/{name}``'s ``embedder``) and
        the path to record: one of the tenant's fine-tuned embedders (``ft-emb-...``, published
        under ``$TANDEM_HOME/models/embedders/<tenant>/``; another tenant's is not found), or a
        base model as ``embedding_model`` resolves it."""
        if is_embedder_name(name):
            found = find_embedder(self.home, tenant, name)
            if found is None:
                raise NotFound(
                    f"embedder {name!r} not found (none of this tenant's published embedders has that name)",
                    param="embedder",
                    code="embedder_not_found",
                )
            folder, manifest = found
            emb = self.embedder_for(folder, backend)
            check_dim(name, emb.dim, manifest.dim, "its manifest (tandem_embedder.json)")
            return emb, str(folder)
        try:
            return self.embedder_named(name, backend=backend)
        except (InvalidRequest, OSError) as exc:  # OSError: a name no file system could hold
            why = exc.message if isinstance(exc, InvalidRequest) else (exc.strerror or str(exc))
            raise InvalidRequest(
                f"embedder {name!r} is neither a fine-tuned embedder of this tenant nor a base model: {why}",
                param="embedder",
                code="embedder_not_found",
            ) from None

    def version_embedder(
        self, tenant: str, version: IndexVersion, backend: EmbeddingBackend = "torch"
    ) -> Embedder:
        """The embedder of an index version (run by the collection's ``backend``), checked
        against the dimension it was built with."""
        if is_embedder_name(version.embedder):
            emb, _ = self.resolve_embedder(tenant, version.embedder, backend)
        else:
            emb, _ = self.embedder_named(version.embedder, version.model_path, backend)
        check_dim(version.embedder, emb.dim, version.dim, f"index version {version.version}")
        return emb

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
        embedding_backend: EmbeddingBackend | None = None,
        keep_hidden_text: bool = False,
        ocr_language: str = "en",
    ) -> CollectionConfig:
        validate_name(name)
        check_language(ocr_language)
        if self.backend.exists(tenant, name):
            raise Conflict(f"collection {name!r} already exists", param="name", code="collection_exists")
        model = embedding_model or self.settings.embedding_model
        if self.settings.embedder_url and embedding_backend not in (None, "torch"):
            raise InvalidRequest(
                f"embedding_backend {embedding_backend!r} needs the model in this service, but it "
                "embeds through TANDEM_RETRIEVAL_EMBEDDER_URL",
                param="embedding_backend",
            )
        embedder, model_path = self.embedder_named(
            model, backend=embedding_backend or self.settings.embedding_backend
        )
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
            backend=self.backend.name,
            # What actually embeds (torch when the ONNX packages are missing), not what was asked.
            embedding_backend=getattr(embedder, "backend", "torch"),
            keep_hidden_text=keep_hidden_text,
            ocr_language=ocr_language,
        )
        self.backend.create(tenant, config)
        return config

    def config(self, tenant: str, name: str) -> CollectionConfig:
        return self.backend.load_config(tenant, validate_name(name))

    def set_ocr_language(self, tenant: str, name: str, language: str) -> CollectionConfig:
        """Read the collection's scanned pages and images in ``language`` from now on (files
        ingested before keep their text). Workers read the setting afresh for each job."""
        check_language(language)
        with self._lock:
            config = self.config(tenant, name)
            config.ocr_language = language
            self.backend.save_config(tenant, config)
            col = self._open.get((tenant, name))
            if col is not None:
                col.config.ocr_language = language
        return config

    def list(self, tenant: str) -> list[CollectionConfig]:
        return self.backend.list_configs(tenant)

    def get(self, tenant: str, name: str) -> ChunkedCollection:
        key = (tenant, name)
        with self._lock:
            col = self._open.get(key)
            if col is not None and self.backend.exists(tenant, name):
                return col
            if col is not None:  # deleted by another process
                self._open.pop(key).close(checkpoint=False)
            config = self.config(tenant, name)
            embedder, _ = self.embedder_named(
                config.embedding_model,
                config.model_path,
                config.embedding_backend,  # type: ignore[arg-type]
            )
            if embedder.dim != config.dim:
                # Another model now answers to this name (here or on the embedding server):
                # its vectors would not fit the collection's index.
                raise Conflict(
                    f"collection {name!r} holds {config.dim}-dimensional vectors of "
                    f"{config.embedding_model!r}, but that model now gives {embedder.dim}",
                    param="embedding_model",
                    code="embedding_dimension_mismatch",
                )
            parts = CollectionParts(
                self.path_of(tenant, name),
                config,
                embedder,
                self.options(config.index),
                self.reranker(),
                # every version of the collection runs on its backend (torch, onnx, onnx-int8)
                embedders=functools.partial(
                    self.version_embedder,
                    tenant,
                    backend=config.embedding_backend,  # type: ignore[arg-type]
                ),
            )
            col = self.backend.open(tenant, parts)
            self._open[key] = col
            return col

    def delete(self, tenant: str, name: str) -> None:
        self.config(tenant, name)  # 404 if missing
        with self._lock:
            col = self._open.pop((tenant, name), None)
        if col is not None:
            col.close(checkpoint=False)
        self.backend.delete(tenant, name)

    def close_all(self) -> None:
        with self._lock:
            cols = list(self._open.values())
            self._open.clear()
        for col in cols:
            col.close()
        self.backend.close()
