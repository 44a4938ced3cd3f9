"""Reciprocal-rank fusion (Cormack et al., 2009) with per-ranking weights."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def rrf(
    rankings: Mapping[str, np.ndarray], weights: Mapping[str, float], k: int = 60
) -> list[tuple[int, float]]:
    """Fuse ranked vid lists: score(v) = sum over rankings of weight / (k + rank), rank from 1.
    Ties keep the smaller vid first so results are deterministic."""
    fused: dict[int, float] = {}
    for name, vids in rankings.items():
        w = float(weights.get(name, 1.0))
        if w == 0:
            continue
        for rank, vid in enumerate(vids.tolist(), start=1):
            fused[vid] = fused.get(vid, 0.0) + w / (k + rank)
    return sorted(fused.items(), key=lambda kv: (-kv[1], kv[0]))
