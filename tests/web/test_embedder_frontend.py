"""The training page for embedder jobs (issue 17) in a real browser against doubles of the APIs:
the held-out retrieval figures (nDCG@10, Recall@100, ...) before -> after, the published
embedder named instead of a chat box, and an embedder job started from a collection alone."""

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
    page.get_by_label("Collection").fill("handbook")
    page.get_by_label("Held-out share").fill("0.2")
    page.get_by_role("button", name="Start training").click()
    page.wait_for_url(re.compile(r".*#/training/ftjob-new$"))
    sent = posted[0]
    assert sent["type"] == "embedder" and sent["collection"] == "handbook" and sent["eval_fraction"] == 0.2
    assert "dataset" not in sent and "lora" not in sent and "packing" not in sent
