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


_cache: dict[str, CrossEncoderReranker] = {}
_cache_lock = threading.Lock()


def get_reranker(path: Path) -> CrossEncoderReranker:
    with _cache_lock:
        r = _cache.get(str(path))
        if r is None:
            r = _cache[str(path)] = CrossEncoderReranker(path)
        return r
