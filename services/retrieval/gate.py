"""A reindex's quality gate (``PATCH /v1/collections/{name}`` with ``only_if_better``): before a
collection switches to a new index version, the held-out queries are searched on the active
version and on the new one (its staged vectors in a dense index of their own, beside the
collection's sparse index, fused as a search fuses them), and each version's nDCG@10 by
document is taken. The switch happens only when the new version is better by more than
``min_gain``; otherwise the reindex drops it, and no search ever answered from it.
"""

from __future__ import annotations

import statistics
from typing import TypedDict

from services.common.ranking import first_seen, ndcg_at
from services.retrieval.core.collection import CandidateIndex, Collection
from services.retrieval.core.embedder import Embedder
from services.retrieval.core.versions import IndexVersion
from services.retrieval.protocol import ReindexGate

K = 10
# Chunks a gate query's search returns: enough to hold K distinct documents where documents
# have several chunks each.
DEPTH = 50


def score(col: Collection, gate: ReindexGate, candidate: CandidateIndex | None = None) -> float:
    """Mean nDCG@10 (by document) of the gate's queries on the active version, or ``candidate``."""
    per_query = []
    for q in gate.queries:
        hits = col.search(q.query, top_k=DEPTH, mode=gate.mode, candidate=candidate)
        ranked = first_seen(h.document_id for h in hits)
        per_query.append(ndcg_at(ranked, dict.fromkeys(q.relevant, 1), K))
    return statistics.fmean(per_query)


def candidate_index(col: Collection, target: IndexVersion, embedder: Embedder) -> CandidateIndex:
    """The version being built as a searchable index: its staged vectors (every chunk written
    before the staging ended; the switch embeds later ones)."""
    vids, vectors = col.store.staged_vectors(target.version)
    dense = col.indexes.for_dim(target.dim).dense()
    if len(vids):
        dense.add(vids, vectors)
    return CandidateIndex(embedder, dense)


class GateVerdict(TypedDict):
    """A gated reindex's verdict, stored on its job and spread into the job's result."""

    applied: bool  # the collection switches to the new version
    before: float  # nDCG@10 of the active version
    after: float  # nDCG@10 of the new one
    mode: str
    queries: int
    min_gain: float
    reason: str


def judge(col: Collection, target: IndexVersion, embedder: Embedder, gate: ReindexGate) -> GateVerdict:
    """The verdict on ``target``: ``applied`` (switch or not), both figures and the reason."""
    before = score(col, gate)
    after = score(col, gate, candidate_index(col, target, embedder))
    applied = after > before + gate.min_gain
    figures = f"nDCG@10 {before:.4f} -> {after:.4f} on {len(gate.queries)} held-out queries ({gate.mode})"
    reason = (
        f"{target.embedder} ranks better: {figures}"
        if applied
        else f"{target.embedder} does not rank better by more than {gate.min_gain:g}: {figures}; "
        "the collection keeps its embedder"
    )
    return {
        "applied": applied,
        "before": round(before, 6),
        "after": round(after, 6),
        "mode": gate.mode,
        "queries": len(gate.queries),
        "min_gain": gate.min_gain,
        "reason": reason,
    }
