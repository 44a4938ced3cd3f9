"""A collection's reindex gated by the tenant's regression sets (``POST
/v1/collections/{name}/reindex``): each answerable question of a regression set over the
collection that names a ``source`` becomes a gate query whose relevant documents are the
collection's documents that source names (as the judge matches a citation), and retrieval's
``only_if_better`` judges the new index version on them with the caller's own queries. The agent
asks retrieval over HTTP, with the caller's key: its documents, then the ``PATCH``."""

from __future__ import annotations

from collections.abc import Sequence

from services.agent.clients import ReindexGate, ReindexPatch, RetrievalClient
from services.agent.evals.judge import source_matches
from services.agent.evals.protocol import (
    MAX_GATE_QUERIES,
    MAX_GATE_QUERY,
    MAX_RELEVANT,
    EvalSet,
    GatedReindex,
    GateQuery,
    ReindexRequest,
    ReindexSet,
)
from services.agent.evals.store import EvalStore
from services.common.errors import InvalidRequest
from services.common.jsonsafe import JsonObject


def gate_queries(s: EvalSet, documents: Sequence[JsonObject]) -> tuple[list[GateQuery], ReindexSet]:
    """The set's questions that can judge a ranking: answerable, naming a source that matches at
    least one document (the source's and ``also_in``'s documents are all relevant)."""
    out: list[GateQuery] = []
    unmatched = 0
    for q in s.questions:
        if not q.answerable or not q.source:
            continue
        relevant = [
            str(d["id"])
            for d in documents
            if any(source_matches(src, {**d, "document_id": d["id"]}) for src in q.sources)
        ]
        if not relevant:
            unmatched += 1
            continue
        # retrieval bounds a gate query; the start of a long question still ranks its documents
        out.append(GateQuery(query=q.question[:MAX_GATE_QUERY], relevant=relevant[:MAX_RELEVANT]))
    return out, ReindexSet(id=s.id, name=s.name, queries=len(out), unmatched=unmatched)


async def gated_reindex(
    store: EvalStore, retrieval: RetrievalClient, tenant: str, collection: str, body: ReindexRequest
) -> GatedReindex:
    sets = [s for s in await store.sets(tenant) if s.regression and s.collection == collection]
    regression: list[GateQuery] = []
    used: list[ReindexSet] = []
    if sets:
        documents = await retrieval.documents(collection)
        for s in sets:
            queries, summary = gate_queries(s, documents)
            regression += queries
            used.append(summary)
        if not regression:
            names = ", ".join(repr(s.name) for s in sets)
            raise InvalidRequest(
                f"the regression sets of {collection!r} ({names}) have no answerable question whose "
                f"source names one of its {len(documents)} documents: nothing of them can gate the "
                "reindex (fix their questions' sources, or unmark them as regression sets)",
                param="collection",
                code="no_regression_queries",
            )
    queries = regression + body.queries
    if not body.gate:
        if queries:
            what = "regression sets" if sets else "queries"
            raise InvalidRequest(
                f"gate: false, but {collection!r} has {what} to gate the reindex with: they run first",
                param="gate",
            )
    elif not queries:
        raise InvalidRequest(
            f"nothing to gate the reindex of {collection!r} with: the tenant has no regression set "
            "over it; give queries (held-out queries with their relevant document ids), or "
            '"gate": false to reindex without a gate',
            param="queries",
        )
    if len(queries) > MAX_GATE_QUERIES:
        raise InvalidRequest(
            f"{len(regression)} regression and {len(body.queries)} given queries: a gate holds at "
            f"most {MAX_GATE_QUERIES}",
            param="queries",
        )
    patch: ReindexPatch = {"embedder": body.embedder}
    if queries:
        gate: ReindexGate = {"queries": [{"query": q.query, "relevant": q.relevant} for q in queries]}
        if body.mode is not None:
            gate["mode"] = body.mode
        if body.min_gain is not None:
            gate["min_gain"] = body.min_gain
        patch["only_if_better"] = gate
    job = await retrieval.reindex(collection, patch)
    return GatedReindex(
        **job, gated=bool(queries), regression_queries=len(regression), queries=len(queries), sets=used
    )
