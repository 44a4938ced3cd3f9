"""An embedder job's ``apply`` step: after the embedder is trained and published, the
collection switches to it only if it ranks the job's held-out pairs better.

The decision is the retrieval service's reindex gate (``PATCH /v1/collections/{name}`` with
``only_if_better``: services/retrieval/gate.py): the new embedder's index version is built
beside the active one, both are scored on the held-out queries (nDCG@10 by document, hybrid
search as users search), and the collection switches only when the new one is better; a worse
version is dropped before any search answers from it. The worker asks as the job's tenant (the
operator key acting for it), so another tenant's collection stays a 404.

The outcome (``ApplyOutcome``) is kept on the job as it goes: the reindex job's id first, so a
worker that dies while it waits is followed by one that waits for the same reindex rather
than starting a second.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TypedDict
from urllib.parse import quote

import httpx

from services.common.config import CommonSettings
from services.common.jobs import TERMINAL
from services.common.replicas import replica_pool, request_sync
from services.trainer.data.pairs import TITLE_STAGE, EmbedderPair, relevant_document
from services.trainer.protocol import ApplyOutcome
from services.trainer.questions import acting_headers
from services.trainer.store import TrainerStore

POLL_S = 2.0
# How long the worker follows a reindex: re-embedding a large collection on a CPU takes minutes.
WAIT_S = 6 * 3600.0


class GateQuery(TypedDict):
    """A query of the retrieval service's reindex gate (its ``only_if_better.queries``)."""

    query: str
    relevant: list[str]  # the documents it should find


def gate_queries(held_out: list[EmbedderPair]) -> list[GateQuery]:
    """The held-out pairs as the gate's queries: each query with the documents it should find."""
    relevant: dict[str, list[str]] = {}
    for pair in held_out:
        doc = relevant_document(pair)
        if doc is not None and doc not in relevant.setdefault(pair["query"], []):
            relevant[pair["query"]].append(doc)
    return [{"query": q, "relevant": docs} for q, docs in relevant.items() if docs]


def yardstick(held_out: list[EmbedderPair]) -> str:
    titles = bool(held_out) and all(p.get("_stage") == TITLE_STAGE for p in held_out)
    return "titles and headings" if titles else "labelled pairs"


def apply_embedder(
    job_id: str,
    tenant: str,
    collection: str,
    embedder: str,
    held_out: list[EmbedderPair],
    *,
    store: TrainerStore,
    common: CommonSettings,
    keep_going: Callable[[], object],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> ApplyOutcome:
    """Switch ``collection`` to ``embedder`` if it ranks ``held_out`` better; the outcome is
    also stored on the job. ``keep_going`` is called while it waits (it raises when the job's
    lease is lost)."""
    queries = gate_queries(held_out)
    saved = store.job(job_id).get("apply")
    outcome = (
        ApplyOutcome.model_validate_json(saved)
        if saved
        else ApplyOutcome(yardstick=yardstick(held_out), held_out=len(queries))
    )
    if outcome.applied is not None:
        return outcome  # decided before a crash
    if not queries:
        return _decided(store, job_id, outcome, False, "no held-out pair names a document of the collection")
    pool = replica_pool([common.url_of("retrieval")], "retrieval")
    headers = acting_headers(common, tenant, "apply")
    if outcome.reindex_job is None:
        body = {"embedder": embedder, "only_if_better": {"queries": queries, "mode": outcome.mode}}
        try:
            resp = request_sync(
                pool,
                "PATCH",
                f"/v1/collections/{quote(collection, safe='')}",
                idempotent=False,
                headers=headers,
                json=body,
                timeout=120.0,
            )
        except httpx.HTTPError as exc:
            return _decided(store, job_id, outcome, False, f"the retrieval service was not reachable: {exc}")
        if resp.status_code != 202:
            return _decided(store, job_id, outcome, False, f"the reindex was refused: {_message(resp)}")
        outcome.reindex_job = str(resp.json()["job_id"])
        _save(store, job_id, outcome)
        store.log(job_id, f"apply: reindex job {outcome.reindex_job} scores {len(queries)} held-out queries")
    deadline = clock() + WAIT_S
    while clock() < deadline:
        keep_going()
        try:
            resp = request_sync(pool, "GET", f"/v1/jobs/{outcome.reindex_job}", headers=headers, timeout=60.0)
        except httpx.HTTPError:
            sleep(POLL_S)  # a restarting retrieval service: ask again
            continue
        if resp.status_code != 200:
            return _decided(
                store, job_id, outcome, False, f"the reindex job could not be read: {_message(resp)}"
            )
        job = resp.json()
        if job.get("status") in TERMINAL:
            result = job.get("result") or {}
            if job["status"] != "succeeded" or "applied" not in result:
                return _decided(
                    store,
                    job_id,
                    outcome,
                    False,
                    f"the reindex job {job['status']}: {job.get('error') or result}",
                )
            outcome.before, outcome.after = result.get("before"), result.get("after")
            return _decided(store, job_id, outcome, bool(result["applied"]), str(result.get("reason", "")))
        sleep(POLL_S)
    return _decided(store, job_id, outcome, False, f"the reindex did not end within {WAIT_S:.0f} s")


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {resp.status_code}"


def _save(store: TrainerStore, job_id: str, outcome: ApplyOutcome) -> None:
    store.update(job_id, apply=outcome.model_dump_json())


def _decided(
    store: TrainerStore, job_id: str, outcome: ApplyOutcome, applied: bool, reason: str
) -> ApplyOutcome:
    outcome.applied, outcome.reason = applied, reason
    _save(store, job_id, outcome)
    store.log(job_id, f"apply: {'applied' if applied else 'not applied'}: {reason}")
    store.event(job_id, "apply", json.loads(outcome.model_dump_json()))
    return outcome
