"""Embedders: the ``Embedder`` protocol and its sentence-transformers implementation.

A model is loaded once per process and shared by every collection and request
that uses it (``get_embedder``); see the class docstring for how it uses threads.
``OnnxEmbedder`` runs the same model through ONNX Runtime (fp32 or int8), exported
here from the local folder (``onnx_export.py``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from services.common.embedding_models import pick_dtype
from services.common.platforms import current_platform
from services.retrieval.core.onnx_export import EmbeddingBackend, QuantConfig, ensure_export, onnx_missing
from services.retrieval.metrics import timed_batch

log = logging.getLogger("tandem.retrieval")


class Embedder(Protocol):
    name: str

    @property
    def dim(self) -> int:
        """Vector size (read-only: ``HttpEmbedder`` learns it from the server on first use)."""
        ...

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        """float32 [n, dim], L2-normalised."""
        ...

    def embed_query(self, text: str) -> np.ndarray:
        """float32 [dim], L2-normalised."""
        ...

    def token_offsets(self, text: str) -> list[tuple[int, int]]:
        """Character spans of the model's tokens in ``text`` (for token-aware chunking)."""
        ...


class SentenceTransformerEmbedder:
    """sentence-transformers model behind the ``Embedder`` protocol.

    Threads: torch's OpenMP pool belongs to the calling thread, and on a busy CPU a
    multi-threaded forward pass stalls at every barrier whenever one of its threads is
    descheduled (measured under load: 1.4-1.9 s per query with 2 threads, 0.07-0.09 s with 1).
    So on the CPU the model runs on dedicated threads with one OpenMP thread each: one for
    queries (never queued behind an ingestion) and ``workers`` for document batches, which run
    side by side (data parallel instead of intra-op parallel). Accelerators get one thread each.
    """

    backend: EmbeddingBackend = "torch"

    def __init__(
        self,
        path: Path,
        *,
        batch_size: int = 64,
        dtype: str = "auto",
        workers: int = 0,
        device: str | None = None,
    ) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from sentence_transformers import SentenceTransformer

        self.path = path
        self.name = path.name
        self.batch_size = batch_size
        self.device = torch.device(device) if device else current_platform().device()
        self.torch_dtype = pick_dtype(dtype)
        self.model = SentenceTransformer(
            str(path), device=str(self.device), model_kwargs={"dtype": self.torch_dtype}
        )
        self.model.eval()
        get_dim: Any = (
            getattr(self.model, "get_embedding_dimension", None)
            or self.model.get_sentence_embedding_dimension
        )
        self.dim = int(get_dim())
        self._torch = torch
        on_cpu = self.device.type == "cpu"
        self.workers = (workers or min(os.cpu_count() or 1, 4)) if on_cpu else 1

        def one_thread() -> None:
            if on_cpu:
                torch.set_num_threads(1)

        self._query_pool = ThreadPoolExecutor(1, f"embed-q-{self.name}", initializer=one_thread)
        self._batch_pool = ThreadPoolExecutor(self.workers, f"embed-b-{self.name}", initializer=one_thread)
        # The HF fast tokenizer is not safe to call from several threads at once.
        self._tok_lock = threading.Lock()
        backend = getattr(self.model.tokenizer, "backend_tokenizer", None)
        self._fast: Any = None
        if backend is not None:
            # A private copy: the model's own tokenizer carries padding/truncation state that
            # sentence-transformers changes per call, which would make chunking depend on history.
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_str(backend.to_str())
            self._fast.no_truncation()
            self._fast.no_padding()

    @property
    def max_tokens(self) -> int:
        value: Any = getattr(self.model, "max_seq_length", None)
        return int(value or 512)

    @timed_batch("torch")
    def _encode_now(self, texts: list[str]) -> np.ndarray:
        torch = self._torch
        with self._tok_lock:
            prepare = getattr(self.model, "preprocess", None) or self.model.tokenize
            features = prepare(texts)
        features = {k: v.to(self.device) if hasattr(v, "to") else v for k, v in features.items()}
        with torch.inference_mode():
            out = self.model(features)["sentence_embedding"]
            out = torch.nn.functional.normalize(out.float(), p=2, dim=-1)
        return np.ascontiguousarray(out.cpu().numpy(), dtype=np.float32)

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        # Sort by length across the whole request so batches carry little padding.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        batches = [order[s : s + self.batch_size] for s in range(0, len(order), self.batch_size)]
        futures = [self._batch_pool.submit(self._encode_now, [texts[i] for i in idx]) for idx in batches]
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for idx, fut in zip(batches, futures, strict=True):
            out[idx] = fut.result()
        return out

    def embed_query(self, text: str) -> np.ndarray:
        return self._query_pool.submit(self._encode_now, [text]).result()[0]

    def token_offsets(self, text: str) -> list[tuple[int, int]]:
        if self._fast is not None:
            return [(int(a), int(b)) for a, b in self._fast.encode(text, add_special_tokens=False).offsets]
        enc = self.model.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return [(int(a), int(b)) for a, b in enc["offset_mapping"]]


class OnnxEmbedder(SentenceTransformerEmbedder):
    """The same model through ONNX Runtime on the CPU: fp32, or int8 with ``quant`` (dynamic
    quantisation: int8 weights, activations quantised per batch).

    The int8 model embeds both the documents and the queries of its collections, so a query is
    never compared with vectors of another model; a collection's backend is fixed at creation
    (``CollectionConfig.embedding_backend``). Each text is its own run (see ``_encode_now``).
    Tokenisation, truncation, chunking offsets and
    the thread layout are the torch embedder's: one ONNX Runtime session with one intra-op
    thread, run concurrently by the same dedicated threads (``InferenceSession.run`` is
    thread-safe and releases the GIL)."""

    def __init__(
        self,
        path: Path,
        *,
        cache_root: Path,
        quant: QuantConfig | None = None,
        batch_size: int = 64,
        workers: int = 0,
    ) -> None:
        # fp32 on the CPU: the model is the export's source and the tokenizer's owner.
        super().__init__(path, batch_size=batch_size, dtype="float32", workers=workers, device="cpu")
        import onnxruntime as ort

        self.backend = "onnx" if quant is None else "onnx-int8"
        self.onnx_path = ensure_export(self.model, path, cache_root, quant)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = ort.InferenceSession(str(self.onnx_path), opts, providers=["CPUExecutionProvider"])
        self._inputs = [i.name for i in self._session.get_inputs()]

    @timed_batch("onnx")
    def _encode_now(self, texts: list[str]) -> np.ndarray:
        with self._tok_lock:
            prepare = getattr(self.model, "preprocess", None) or self.model.tokenize
            features = prepare(texts)
        feed = {n: np.ascontiguousarray(features[n].numpy(), dtype=np.int64) for n in self._inputs}
        # One text per run, unpadded. int8: dynamic quantisation scales activations by the
        # min/max of the whole input (padding included), so a text's vector would depend on its
        # batch-mates (a document re-embedded in another batch, or the same text as a query,
        # would differ: cosine ~0.99); per text, each vector is a function of its text alone.
        # And on one thread it is faster than padded batches for fp32 too (measured on SciFact
        # abstracts: 5.2-5.9 against 2.8-4.0 docs/s fp32, 9.2-10.2 int8 either way).
        real = features["attention_mask"].numpy().astype(bool)  # the tokens, wherever padding is
        rows = [
            self._session.run(["sentence_embedding"], {n: v[i : i + 1, keep] for n, v in feed.items()})[0]
            for i, keep in enumerate(real)
        ]
        out = np.concatenate(rows).astype(np.float32)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return np.ascontiguousarray(out / np.maximum(norms, 1e-12), dtype=np.float32)


_cache: dict[tuple[object, ...], SentenceTransformerEmbedder] = {}
_cache_lock = threading.Lock()


def get_embedder(
    path: Path,
    *,
    batch_size: int = 64,
    dtype: str = "auto",
    workers: int = 0,
    backend: EmbeddingBackend = "torch",
    cache_root: Path | None = None,
    quant: QuantConfig | None = None,
) -> SentenceTransformerEmbedder:
    """The process-wide instance for this model and backend (loaded on first use).

    ``backend`` "onnx"/"onnx-int8" need onnxruntime, onnx and onnxscript, and ``cache_root`` (where
    exports are kept); without the packages this warns and gives the torch embedder."""
    if backend != "torch":
        missing = onnx_missing()
        if missing is not None:
            log.warning(
                "embedding backend %r unavailable (%s): embedding %s with torch instead",
                backend,
                missing,
                path.name,
            )
            backend = "torch"
    if backend == "torch":
        key: tuple[object, ...] = (str(path), batch_size, dtype, workers, "torch")
    else:
        if cache_root is None:
            raise ValueError("the ONNX embedding backends need cache_root (where exports are kept)")
        q = (quant or QuantConfig()) if backend == "onnx-int8" else None
        key = (str(path), batch_size, workers, backend, str(cache_root), q)
    with _cache_lock:
        emb = _cache.get(key)
        if emb is None:
            if backend == "torch":
                emb = SentenceTransformerEmbedder(path, batch_size=batch_size, dtype=dtype, workers=workers)
            else:
                assert cache_root is not None
                emb = OnnxEmbedder(
                    path, cache_root=cache_root, quant=q, batch_size=batch_size, workers=workers
                )
            _cache[key] = emb
        return emb


SERVER = "embedding server"  # the inference service, as HttpEmbedder's errors name it


class HttpEmbedder:
    """``Embedder`` over an inference service's ``/v1/embeddings``: many retrieval replicas share
    one embedding server and load no model. Chunking needs the model's token offsets on every
    ingest, so the model's fast tokenizer is fetched once (a Tandem extension route) and run here.
    The server's model metadata is fetched on first use, so this service starts (and becomes
    ready) before the embedding server does."""

    def __init__(
        self, url: str, api_key: str, model: str, *, batch_size: int = 64, timeout: float = 120.0
    ) -> None:
        from services.common.openai_client import OpenAIClient

        self.url = url.rstrip("/").removesuffix("/v1")
        self._client = OpenAIClient(self.url, api_key, service=SERVER, timeout=timeout, persistent=True)
        self.name = model
        self.batch_size = batch_size
        self._meta_lock = threading.Lock()
        self._dim: int | None = None
        self._max_tokens = 0
        self._fast: Any = None

    def _meta(self) -> None:
        if self._dim is not None:
            return
        with self._meta_lock:
            if self._dim is not None:
                return
            from tokenizers import Tokenizer

            body = self._request("GET", f"/embeddings/tokenizer/{self.name}")
            fast = Tokenizer.from_str(body["tokenizer"])
            fast.no_truncation()
            fast.no_padding()
            self._fast, self._max_tokens = fast, int(body["max_tokens"])
            self._dim = int(body["dimensions"])

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """The JSON answer of ``/v1{path}``; failures named for ``embedding_model``."""
        from services.common.upstream import model_server_errors

        with model_server_errors(SERVER, self.url, model=self.name, param="embedding_model"):
            return self._client.request_sync(method, path, body)

    @property
    def dim(self) -> int:
        self._meta()
        assert self._dim is not None
        return self._dim

    @property
    def max_tokens(self) -> int:
        self._meta()
        return self._max_tokens

    @timed_batch("http")
    def _embed(self, texts: list[str]) -> np.ndarray:
        import base64

        from services.common.errors import UpstreamError

        body = self._request(
            "POST",
            "/embeddings",
            # truncate_prompt_tokens=-1: cut at the model's limit, as the in-process embedder does.
            {"model": self.name, "input": texts, "encoding_format": "base64", "truncate_prompt_tokens": -1},
        )
        rows = sorted(body["data"], key=lambda d: d["index"])
        out = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in rows])
        if out.shape != (len(texts), self.dim):
            # The collection's index was built for self.dim: a server now serving another model
            # under this name must not corrupt it.
            raise UpstreamError(
                f"{SERVER} {self.url} gave vectors of shape {out.shape} for {len(texts)} texts; "
                f"{self.name} is {self.dim}-dimensional"
            )
        return out.astype(np.float32)

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        parts = [
            self._embed(list(texts[s : s + self.batch_size])) for s in range(0, len(texts), self.batch_size)
        ]
        return np.concatenate(parts)

    def embed_query(self, text: str) -> np.ndarray:
        return self._embed([text])[0]

    def token_offsets(self, text: str) -> list[tuple[int, int]]:
        self._meta()
        return [(int(a), int(b)) for a, b in self._fast.encode(text, add_special_tokens=False).offsets]


_http_cache: dict[tuple[str, str, str, int], HttpEmbedder] = {}


def get_http_embedder(
    url: str, api_key: str, model: str, *, batch_size: int = 64, timeout: float = 120.0
) -> HttpEmbedder:
    """The process-wide client for this server and model (one connection pool)."""
    key = (url, api_key, model, batch_size)
    with _cache_lock:
        emb = _http_cache.get(key)
        if emb is None:
            emb = _http_cache[key] = HttpEmbedder(url, api_key, model, batch_size=batch_size, timeout=timeout)
        return emb
