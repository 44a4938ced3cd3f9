"""Ranking metrics over document ids (graded relevance, BEIR's definitions): what ``tandem eval
retrieval``, the benchmarks and a reindex's quality gate score rankings with."""

from __future__ import annotations

import math
from collections.abc import Iterable


def ndcg_at(ranked: list[str], rel: dict[str, int], k: int) -> float:
    dcg = sum((2 ** rel.get(d, 0) - 1) / math.log2(i + 2) for i, d in enumerate(ranked[:k]))
    ideal = sorted(rel.values(), reverse=True)[:k]
    idcg = sum((2**g - 1) / math.log2(i + 2) for i, g in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


def recall_at(ranked: list[str], rel: dict[str, int], k: int) -> float:
    relevant = {d for d, g in rel.items() if g > 0}
    return len(relevant & set(ranked[:k])) / len(relevant) if relevant else 0.0


def mrr_at(ranked: list[str], rel: dict[str, int], k: int) -> float:
    for i, d in enumerate(ranked[:k]):
        if rel.get(d, 0) > 0:
            return 1.0 / (i + 1)
    return 0.0


def first_seen(ids: Iterable[str]) -> list[str]:
    """``ids`` without repeats, in order: a chunk ranking collapsed to its documents."""
    return list(dict.fromkeys(ids))
