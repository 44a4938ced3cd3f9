"""Rerankers: the ``Reranker`` protocol and a sentence-transformers CrossEncoder implementation."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import numpy as np

from services.common.platforms import current_platform


class Reranker(Protocol):
    name: str

    def score(self, query: str, texts: Sequence[str]) -> np.ndarray:
        """One relevance score per text (higher is more relevant)."""
        ...


class CrossEncoderReranker:
    def __init__(self, path: Path, *, batch_size: int = 32) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import CrossEncoder

        self.name = path.name
        self.batch_size = batch_size
        self.model = CrossEncoder(str(path), device=str(current_platform().device()))
        # One thread for the model, as in embedder.py (torch's OpenMP pool is per calling thread).
        on_cpu = current_platform().device_type == "cpu"

        def one_thread() -> None:
            if on_cpu:
                import torch

                torch.set_num_threads(1)

        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="rerank", initializer=one_thread
        )

    def score(self, query: str, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros(0, dtype=np.float32)
        out = self._executor.submit(
            self.model.predict,
            [(query, t) for t in texts],
            batch_size=self.batch_size,
            show_progress_bar=False,
        ).result()
        arr = np.asarray(out, dtype=np.float32)
        # Multi-label heads give [n, labels]; the last label is "relevant" by convention.
        return arr if arr.ndim == 1 else arr[:, -1]


SERVER = "rerank server"  # the inference service, as HttpReranker's errors name it


class HttpReranker:
    """``Reranker`` over an inference service's ``/v1/rerank`` (vLLM's and Jina's shape), so
    retrieval replicas share one cross-encoder server."""

    def __init__(self, url: str, api_key: str, model: str, *, timeout: float = 120.0) -> None:
        from services.common.openai_client import OpenAIClient

        self.url = url.rstrip("/").removesuffix("/v1")
        self._client = OpenAIClient(self.url, api_key, service=SERVER, timeout=timeout, persistent=True)
        self.name = model

    def score(self, query: str, texts: Sequence[str]) -> np.ndarray:
        from services.common.errors import UpstreamError
        from services.common.upstream import model_server_errors

        if not texts:
            return np.zeros(0, dtype=np.float32)
        body = {"model": self.name, "query": query, "documents": list(texts), "return_documents": False}
        with model_server_errors(SERVER, self.url, model=self.name, param="reranker_model"):
            results = self._client.request_sync("POST", "/rerank", body)["results"]
        out = np.zeros(len(texts), dtype=np.float32)
        if sorted(r["index"] for r in results) != list(range(len(texts))):
            raise UpstreamError(f"{SERVER} {self.url} did not score each of the {len(texts)} texts once")
        for r in results:
            out[r["index"]] = r["relevance_score"]
        return out


_cache: dict[str, CrossEncoderReranker] = {}
_cache_lock = threading.Lock()


def get_reranker(path: Path) -> CrossEncoderReranker:
    with _cache_lock:
        r = _cache.get(str(path))
        if r is None:
            r = _cache[str(path)] = CrossEncoderReranker(path)
        return r


_http_cache: dict[tuple[str, str, str], HttpReranker] = {}


def get_http_reranker(url: str, api_key: str, model: str, *, timeout: float = 120.0) -> HttpReranker:
    with _cache_lock:
        key = (url, api_key, model)
        r = _http_cache.get(key)
        if r is None:
            r = _http_cache[key] = HttpReranker(url, api_key, model, timeout=timeout)
        return r
