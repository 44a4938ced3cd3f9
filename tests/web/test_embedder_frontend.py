"""The training page for embedder jobs (issue 17) in a real browser against doubles of the APIs:
the held-out retrieval figures (nDCG@10, Recall@100, ...) before -> after, the published
embedder named instead of a chat box, and an embedder job started from a collection alone."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.web.test_frontend import BASE_ROUTES, double_api, serve_site, sign_in
from tests.web.test_loop_frontend import MODELS, body_of, chat_double


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    with serve_site(chat_double) as url:
        yield url


def test_embedder_job_shows_retrieval_figures_and_starts_from_a_collection(page: Any, site: str) -> None:
    job = {
        "id": "ftjob-e1",
        "type": "embedder",
        "base_model": "all-MiniLM-L6-v2",
        "status": "succeeded",
        "progress": {"step": 40, "total": 40},
        "fine_tuned_model": "ft-emb-e1",
        "published": True,
        "metrics": {
            "loss": 0.4,
            "eval_ndcg@10_before": 0.6521,
            "eval_ndcg@10_after": 0.7013,
            "eval_recall@100_before": 0.91,
            "eval_recall@100_after": 0.94,
        },
    }
    posted: list[Any] = []

    def create(req: Any) -> tuple[int, Any]:
        posted.append(body_of(req))
        return 201, {**job, "id": "ftjob-new", "status": "queued"}

    double_api(
        page,
        {
            **BASE_ROUTES,
            r"GET /api/trainer/v1/jobs": lambda r: (200, {"data": [job]}),
            r"GET /api/trainer/v1/jobs/ftjob-e1": lambda r: (200, job),
            r"GET /api/trainer/v1/jobs/ftjob-new": lambda r: (200, {**job, "id": "ftjob-new"}),
            r"GET /api/trainer/v1/jobs/[\w-]+/metrics": lambda r: (200, {"data": [{"step": 1, "loss": 0.9}]}),
            r"GET /api/trainer/v1/files": lambda r: (200, {"data": []}),
            r"POST /api/trainer/v1/jobs": create,
            r"GET /api/inference/v1/models": lambda r: (200, MODELS),
        },
    )
    sign_in(page, site)
    page.goto(f"{site}/#/training/ftjob-e1")
    table = page.locator("#eval-metrics .eval-table")
    table.wait_for()
    rows = {
        r.get_attribute("data-metric"): [r.locator(c).inner_text() for c in (".before", ".after", ".trend")]
        for r in table.locator("tbody tr").all()
    }
    assert rows == {
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
