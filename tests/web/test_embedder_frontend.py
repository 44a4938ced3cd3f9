"""The training page for embedder jobs (issue 17) in a real browser against doubles of the APIs:
the held-out retrieval figures (nDCG@10, Recall@100, ...) before -> after, the published
embedder named instead of a chat box, an embedder job started from a collection alone, and one on
the collection's chunks with hard negatives from its search."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.web.test_frontend import serve_site, sign_in
from tests.web.test_loop_frontend import chat_double, double_training_api, eval_rows


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    with serve_site(chat_double) as url:
        yield url


def test_embedder_job_shows_retrieval_figures_and_starts_from_a_collection(page: Any, site: str) -> None:
    figures = {"ndcg@10": (0.6521, 0.7013), "recall@100": (0.91, 0.94)}
    metrics = {
        f"eval_{k}_{phase}": v[n] for k, v in figures.items() for n, phase in enumerate(("before", "after"))
    }
    job = dict(
        id="ftjob-e1",
        type="embedder",
        base_model="all-MiniLM-L6-v2",
        status="succeeded",
        progress={"step": 40, "total": 40},
        fine_tuned_model="ft-emb-e1",
        published=True,
        metrics={"loss": 0.4, **metrics},
    )
    posted = double_training_api(page, [job], [], {**job, "id": "ftjob-new"})
    sign_in(page, site)
    assert eval_rows(page, f"{site}/#/training/ftjob-e1") == {
        "ndcg@10": ["0.6521", "0.7013", "better"],
        "recall@100": ["91.0%", "94.0%", "better"],
    }
    assert "ft-emb-e1" in page.locator("#embedder-published").inner_text()
    assert page.locator("#model-chat-input").count() == 0  # an embedder is not chatted with

    page.get_by_label("Type").select_option("embedder")
    assert page.get_by_label("Base model").input_value() == "all-MiniLM-L6-v2"
    assert page.locator("#job-lora").is_disabled()
    page.get_by_label("Collection", exact=True).fill("handbook")
    page.get_by_label("Held-out share").fill("0.2")
    page.get_by_role("button", name="Start training").click()
    page.wait_for_url(re.compile(r".*#/training/ftjob-new$"))
    sent = posted[0]
    assert sent["type"] == "embedder" and sent["collection"] == "handbook" and sent["eval_fraction"] == 0.2
    assert "dataset" not in sent and "lora" not in sent and "packing" not in sent


def test_an_embedder_job_can_train_on_its_collections_chunks(page: Any, site: str) -> None:
    """The chunk options show for embedder jobs only, need a collection, and post what the
    trainer takes: positives as chunks, hard negatives from the collection, no title pairs."""
    created = {
        "id": "job-emb",
        "type": "embedder",
        "base_model": "all-MiniLM-L6-v2",
        "status": "queued",
        "progress": {"step": 0, "total": 0},
        "metrics": {},
    }
    files = [{"id": "file-b", "filename": "qrels.tsv", "rows": 500, "format": "beir", "kinds": ["embedder"]}]
    posted = double_training_api(page, [], files, created)
    sign_in(page, site)
    page.goto(f"{site}/#/training")
    page.get_by_label("Type").wait_for()
    assert page.locator("#job-chunk-checks").is_hidden()
    page.get_by_label("Type").select_option("embedder")
    chunks = page.get_by_label("labelled pairs as the collection's chunks, hard negatives from its search")
    chunks.check()
    page.get_by_role("button", name="Start training").click()
    page.get_by_role("alert").filter(has_text="Name the collection").wait_for()
    assert posted == []
    page.get_by_label("Collection", exact=True).fill("scifact")
    page.get_by_label("also train on the collection's titles and headings").uncheck()
    page.get_by_role("button", name="Start training").click()
    page.wait_for_url(re.compile(r".*#/training/job-emb$"))
    (body,) = posted
    assert (body["type"], body["collection"], body["positives"], body["title_pairs"]) == (
        "embedder",
        "scifact",
        "chunks",
        False,
    )
    hp = body["hyperparameters"]
    assert (hp["hard_negatives"], hp["hard_negatives_from"], hp["hard_negatives_skip"]) == (
        3,
        "collection",
        5,
    )
    assert body["dataset"] == "file-b"
