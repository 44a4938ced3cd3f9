"""Retriever tuning with defaults (issue 37): an embedder job that names its collection gets the
measured recipe (titles first, then the labelled pairs as chunks with negatives from the
collection's search), and with ``apply`` it switches the collection to the new embedder only
when that ranks the held-out pairs better. The real retrieval service over HTTP with a real
Celery io worker (the reindex and its gate), the trainer over HTTP, the job's worker in process
with an operator key as TANDEM_SERVICE_API_KEY."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.common.auth import KeyStore
from tests.conftest import auth
from tests.trainer.conftest import jsonl
from tests.trainer.test_embedder import tiny_st

os.environ.setdefault("HF_HUB_OFFLINE", "1")
__all__ = ["tiny_st"]  # a fixture, used here by name

# Queries that share no word with their document: the sparse side cannot find them, so the
# hybrid ranking is the embedder's (a random tiny model ranks them by chance, MiniLM by meaning).
DOCS = {
    "cats": ("Cats", "Cats purr and chase mice around the barn at night."),
    "dogs": ("Dogs", "Dogs bark at the mail carrier every single morning."),
    "rain": ("Rain", "Heavy rain flooded the valley roads after the storm."),
    "code": ("Compilers", "The compiler rejected the program because of a type error."),
    "bread": ("Bread", "Knead the dough, let it rise, then bake the loaf until golden."),
}
QUERIES = {
    "cats": ["a feline hunting rodents", "kitten stalking prey"],
    "dogs": ["a puppy yelping at the postman", "hound noise in the early hours"],
    "rain": ["weather disaster", "a deluge submerged the highway"],
    "code": ["software bug", "build failure from wrong variable kinds"],
    "bread": ["baking a baguette", "making sourdough"],
}


@dataclass
class Rig:
    c: httpx.Client
    trainer: str
    retrieval: str
    run_worker: Any
    upload: Any
    pairs: str  # the labelled pairs' file id


@pytest.fixture()
def rig(
    tandem_env: Path, tiny_st: Path, api_key: str, key_store: KeyStore, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Rig]:
    from services.retrieval.app import create_app as retrieval_app
    from tests.helpers.servers import celery_worker, serve_app
    from tests.retrieval.conftest import IO_WORKER, ONE_THREAD
    from tests.trainer.test_api import serving, upload

    # the collection's embedder: the random tiny model; the packaged MiniLM is allowed as a base
    monkeypatch.setenv("TANDEM_RETRIEVAL_EMBEDDING_MODEL", str(tiny_st))
    monkeypatch.setenv("TANDEM_MODEL_ROOTS", f"{tiny_st.parent}:{tandem_env / 'models'}")
    operator = key_store.create("system", operator=True)[0]
    log = tandem_env / "io-worker.log"
    with (
        serve_app(retrieval_app()) as r_url,
        serving(tiny_st, tandem_env, monkeypatch) as h,
        celery_worker(dict(os.environ), log, f"tune-{os.getpid()}", IO_WORKER, "io", ONE_THREAD),
        httpx.Client(headers=auth(api_key), timeout=300) as c,
    ):
        h.st.common = h.st.common.model_copy(update={"retrieval_url": r_url, "service_api_key": operator})
        assert c.post(f"{r_url}/v1/collections", json={"name": "kb"}).status_code == 201
        documents = [{"id": i, "title": t, "text": x} for i, (t, x) in DOCS.items()]
        added = c.post(f"{r_url}/v1/collections/kb/documents", json={"documents": documents})
        assert added.status_code == 201, added.text
        rows = [
            {"query": q, "positive": DOCS[d][1], "document_id": d} for d, qs in QUERIES.items() for q in qs
        ]
        pairs = upload(h, api_key, jsonl(rows)).json()["id"]
        yield Rig(c, h.base, r_url, h.run_worker, lambda data: upload(h, api_key, data), pairs)


def job(rig: Rig, job_id: str) -> dict[str, Any]:
    return dict(rig.c.get(f"{rig.trainer}/v1/jobs/{job_id}").json())


def collection(rig: Rig) -> dict[str, Any]:
    return dict(rig.c.get(f"{rig.retrieval}/v1/collections/kb").json())


def logs(rig: Rig, job_id: str) -> str:
    return "\n".join(e["message"] for e in rig.c.get(f"{rig.trainer}/v1/jobs/{job_id}/logs").json()["data"])


def test_defaults_tune_and_apply_only_an_embedder_that_ranks_better(rig: Rig, tiny_st: Path) -> None:
    # The call a user scripts: the collection, the labelled pairs, apply; nothing else.
    body = {"type": "embedder", "base_model": "all-MiniLM-L6-v2", "collection": "kb", "dataset": rig.pairs}
    created = rig.c.post(f"{rig.trainer}/v1/jobs", json={**body, "apply": True})
    assert created.status_code == 201, created.text
    first = created.json()
    ran = first["request"]
    assert (ran["positives"], ran["stages"], ran["publish"], ran["eval_fraction"]) == (
        "chunks",
        "titles_first",
        True,
        0.1,
    )
    hp = ran["hyperparameters"]
    assert (hp["learning_rate"], hp["n_epochs"], hp["batch_size"], hp["title_epochs"]) == (8e-5, 4, 32, 1)
    assert (hp["hard_negatives"], hp["hard_negatives_from"], hp["hard_negatives_skip"]) == (
        3,
        "collection",
        5,
    )
    assert first["applied"] is None and first["apply"] is None

    assert rig.run_worker(first["id"]) == "succeeded"
    done = job(rig, first["id"])
    text = logs(rig, first["id"])
    assert "stages: 5 title and heading pairs for 1 epoch(s)" in text, text
    assert "then 9 labelled pairs for 4 epoch(s)" in text, text  # 10 pairs, 1 held out
    outcome = done["apply"]
    assert done["applied"] is True and outcome["applied"] is True, outcome["reason"]
    assert (outcome["yardstick"], outcome["held_out"], outcome["mode"]) == ("labelled pairs", 1, "hybrid")
    assert outcome["before"] < outcome["after"], outcome
    assert outcome["reindex_job"] and "ranks better" in outcome["reason"]
    tuned = done["fine_tuned_model"]
    assert tuned.startswith("ft-emb-") and collection(rig)["embedder"] == tuned

    # From the random tiny model, a job without labelled pairs: its yardstick is the held-out
    # titles, and its embedder ranks them no better than the one the collection now has.
    created = rig.c.post(
        f"{rig.trainer}/v1/jobs",
        json={"type": "embedder", "base_model": str(tiny_st), "collection": "kb", "apply": True},
    )
    assert created.status_code == 201, created.text
    second = created.json()
    assert second["request"]["stages"] == "together" and second["request"]["positives"] == "documents"
    assert rig.run_worker(second["id"]) == "succeeded"
    kept = job(rig, second["id"])
    outcome = kept["apply"]
    assert kept["applied"] is False and outcome["yardstick"] == "titles and headings", outcome
    assert outcome["held_out"] == 1 and outcome["after"] <= outcome["before"], outcome
    assert "keeps its embedder" in outcome["reason"]
    info = collection(rig)
    assert info["embedder"] == tuned and info["reindexing"] is None  # untouched, nothing left building


def test_bad_tuning_requests_are_4xx_naming_the_problem(rig: Rig, other_key: str) -> None:
    body = {"type": "embedder", "base_model": "all-MiniLM-L6-v2", "dataset": rig.pairs, "apply": True}

    def error(resp: httpx.Response, status: int) -> str:
        assert resp.status_code == status, resp.text
        return str(resp.json()["error"]["message"])

    message = error(rig.c.post(f"{rig.trainer}/v1/jobs", json=body), 400)
    assert "'apply'" in message and "'collection'" in message
    # another tenant's collection is as missing as none
    theirs = {"type": "embedder", "base_model": "all-MiniLM-L6-v2", "collection": "kb", "apply": True}
    other = rig.c.post(f"{rig.trainer}/v1/jobs", json=theirs, headers=auth(other_key))
    assert other.status_code == 404 and "kb" in other.text, other.text
    # a labelled row naming a document the collection lacks: the line and the id
    missing = rig.upload(
        jsonl(
            [
                {"query": "q", "positive": "p", "document_id": "cats"},
                {"query": "r", "positive": "s", "document_id": "nope"},
            ]
        )
    )
    message = error(
        rig.c.post(
            f"{rig.trainer}/v1/jobs", json={**body, "collection": "kb", "dataset": missing.json()["id"]}
        ),
        400,
    )
    assert "line 2" in message and "'nope'" in message
    # pairs that name no document, and no titles to hold out: no yardstick, so no apply
    text_only = rig.upload(jsonl([{"query": "q", "positive": "p"}, {"query": "r", "positive": "s"}]))
    resp = rig.c.post(
        f"{rig.trainer}/v1/jobs",
        json={**body, "collection": "kb", "dataset": text_only.json()["id"], "title_pairs": False},
    )
    message = error(resp, 400)
    assert resp.json()["error"]["param"] == "apply" and "no held-out yardstick" in message
    assert "'apply' only applies to embedder jobs" in error(
        rig.c.post(f"{rig.trainer}/v1/jobs", json={**body, "type": "sft"}), 400
    )


def test_applying_to_a_collection_one_may_only_read_is_a_403(rig: Rig, redis_url: str) -> None:
    """Switching a collection's embedder writes it: a reader who is not among its writers may train
    an embedder from it, but not apply one to it."""
    from tests.helpers.people import person

    reader = person(redis_url, "acme")
    put = rig.c.put(
        f"{rig.retrieval}/v1/collections/kb/access", json={"readers": [reader.entry], "writers": []}
    )
    assert put.status_code == 200, put.text
    body = {"type": "embedder", "base_model": "all-MiniLM-L6-v2", "collection": "kb", "dataset": rig.pairs}
    refused = rig.c.post(f"{rig.trainer}/v1/jobs", json={**body, "apply": True}, headers=auth(reader.token))
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["param"] == "apply" and "'kb'" in refused.json()["error"]["message"]
    trained = rig.c.post(f"{rig.trainer}/v1/jobs", json=body, headers=auth(reader.token))
    assert trained.status_code == 201, trained.text
