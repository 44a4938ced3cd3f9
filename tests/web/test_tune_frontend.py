"""Tune retrieval on the documents page (issue 37) in a real browser against doubles of the APIs:
the job the button starts (the collection, ``apply``, a dataset only with a file, the base model
the collection's current embedder decides), its progress, the apply step's nDCG@10 before -> after
and its verdict, a failed job's error, and a 400's message."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.web.test_frontend import BASE_ROUTES, double_api, serve_site, sign_in
from tests.web.test_loop_frontend import body_of, chat_double

PAIRS = '{"query": "how many days of leave?", "positive": "Employees get 25 days of paid leave."}\n'


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    with serve_site(chat_double) as url:
        yield url


class Trainer:
    """The trainer's files and jobs as the panel sees them. ``job`` is what a job read answers
    now (the test moves it on); ``start`` is the status and body a job POST answers with."""

    def __init__(self) -> None:
        self.posted: list[Any] = []
        self.uploads: list[bytes] = []
        self.job: dict[str, Any] = {}
        self.start: tuple[int, Any] = (201, {"id": "ftjob-t1", "type": "embedder", "status": "queued"})

    def upload(self, req: Any) -> tuple[int, Any]:
        self.uploads.append(req.post_data_buffer)
        return 201, {"id": "file-pairs", "filename": "pairs.jsonl", "rows": 1, "format": "pairs"}

    def create(self, req: Any) -> tuple[int, Any]:
        self.posted.append(body_of(req))
        return self.start

    def read(self, req: Any) -> tuple[int, Any]:
        return 200, self.job


def double_tuning(page: Any, collection: dict[str, Any], detail: dict[str, Any] | None) -> Trainer:
    """The retrieval listing holds ``collection`` (and "other"); its own view answers ``detail``
    (404 when None); the trainer is a :class:`Trainer`."""
    trainer = Trainer()
    double_api(
        page,
        {
            **BASE_ROUTES,
            r"GET /api/retrieval/v1/collections": lambda r: (
                200,
                {"collections": [collection, {"name": "other", "embedding_model": "all-MiniLM-L6-v2"}]},
            ),
            r"GET /api/retrieval/v1/collections/[\w.-]+/documents.*": lambda r: (200, {"documents": []}),
            r"GET /api/retrieval/v1/collections/[\w.-]+": lambda r: (
                (200, detail) if detail else (404, {"error": {"type": "not_found", "message": "no view"}})
            ),
            r"POST /api/trainer/v1/files": trainer.upload,
            r"POST /api/trainer/v1/jobs": trainer.create,
            r"GET /api/trainer/v1/jobs/[\w-]+": trainer.read,
        },
    )
    return trainer


def job(status: str, step: int, **more: Any) -> dict[str, Any]:
    return {
        "id": "ftjob-t1",
        "type": "embedder",
        "base_model": "all-MiniLM-L6-v2",
        "status": status,
        "progress": {"step": step, "total": 10},
        "applied": None,
        "apply": None,
        **more,
    }


def open_panel(page: Any, site: str, collection: str) -> None:
    sign_in(page, site)
    page.goto(f"{site}/#/documents/{collection}")
    page.get_by_role("button", name="Tune retrieval").click()
    page.get_by_role("form", name="Tune retrieval").wait_for()


def test_tuning_without_a_file_follows_the_job_to_the_applied_embedder(page: Any, site: str) -> None:
    handbook = {"name": "handbook", "embedding_model": "all-MiniLM-L6-v2"}
    trainer = double_tuning(page, handbook, handbook)
    trainer.job = job("running", 3)
    open_panel(page, site, "handbook")
    panel = page.get_by_role("form", name="Tune retrieval")
    assert "without a file, the collection's titles and headings are used" in panel.inner_text()
    panel.get_by_role("button", name="Start").click()

    status = page.locator("#tune-status")
    page.get_by_role("status").filter(has_text="step 3 of 10").wait_for()
    assert status.inner_text() == "Status: running · step 3 of 10"
    bar = page.get_by_label("Tuning progress")
    assert (bar.get_attribute("value"), bar.get_attribute("max")) == ("3", "10")
    # a base embedder: the tuning starts from the shared one; no file, no dataset, no upload
    assert trainer.posted == [
        {"type": "embedder", "base_model": "all-MiniLM-L6-v2", "collection": "handbook", "apply": True}
    ]
    assert trainer.uploads == []
    assert page.get_by_role("button", name="Start").is_disabled()

    apply = {
        "applied": True,
        "yardstick": "titles and headings",
        "held_out": 40,
        "mode": "hybrid",
        "before": 0.61234,
        "after": 0.70016,
        "reason": "after 0.7002 > before 0.6123",
        "reindex_job": "job-r1",
    }
    trainer.job = job("succeeded", 10, applied=True, apply=apply, fine_tuned_model="ft-emb-abc")
    verdict = page.locator("#tune-verdict")
    verdict.wait_for()
    assert page.locator("#tune-figures").inner_text() == "nDCG@10 0.6123 → 0.7002"
    assert verdict.inner_text() == "Applied: the collection now uses ft-emb-abc."
    assert "40 held-out queries" in page.locator("#tune-result").inner_text()
    assert status.inner_text() == "Status: succeeded · step 10 of 10"
    assert page.get_by_role("button", name="Start").is_enabled()

    # another collection starts with the panel closed; coming back shows the job again
    page.goto(f"{site}/#/documents/other")
    page.get_by_role("heading", name="Collection “other”").wait_for()
    assert page.get_by_role("form", name="Tune retrieval").is_hidden()
    page.goto(f"{site}/#/documents/handbook")
    page.get_by_text("Applied: the collection now uses ft-emb-abc.").wait_for()
    assert page.get_by_role("button", name="Tune retrieval").get_attribute("aria-expanded") == "true"
    assert page.page_errors == []


def test_tuning_with_pairs_starts_from_the_tuned_embedder_and_says_why_not_applied(
    page: Any, site: str, tmp_path: Any
) -> None:
    # The listing names only the collection's first model; its own view names the active one.
    listed = {"name": "handbook", "embedding_model": "all-MiniLM-L6-v2"}
    trainer = double_tuning(page, listed, {**listed, "embedder": "ft-emb-old"})
    trainer.job = job("running", 0)
    open_panel(page, site, "handbook")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(PAIRS)
    page.get_by_label("Labelled pairs").set_input_files(str(pairs))
    page.get_by_role("button", name="Start").click()
    page.locator("#tune-status").wait_for()

    (upload,) = trainer.uploads
    # (the intercepted multipart names the file; Chromium leaves a file's bytes out of it)
    assert b'name="file"; filename="pairs.jsonl"' in upload
    assert trainer.posted == [
        {
            "type": "embedder",
            "base_model": "ft-emb-old",
            "collection": "handbook",
            "dataset": "file-pairs",
            "apply": True,
        }
    ]
    assert "1 rows" in page.locator("#tune-upload").inner_text()

    reason = "after 0.5012 is not above before 0.5100 + min_gain 0.0000"
    apply = {
        "applied": False,
        "yardstick": "labelled pairs",
        "held_out": 12,
        "mode": "hybrid",
        "before": 0.51,
        "after": 0.50123,
        "reason": reason,
        "reindex_job": "job-r2",
    }
    trainer.job = job("succeeded", 10, applied=False, apply=apply, fine_tuned_model="ft-emb-new")
    page.locator("#tune-verdict").wait_for()
    assert page.locator("#tune-figures").inner_text() == "nDCG@10 0.5100 → 0.5012"
    assert page.locator("#tune-verdict").inner_text() == f"Not applied: {reason}"
    assert "labelled pairs" in page.locator("#tune-result").inner_text()


def test_tuning_shows_a_400s_message_and_a_failed_jobs_error(page: Any, site: str) -> None:
    handbook = {"name": "handbook", "embedder": "ft-emb-mine", "embedding_model": "all-MiniLM-L6-v2"}
    # no collection view: the listing's active embedder decides
    trainer = double_tuning(page, handbook, None)
    message = "apply needs a collection: collection 'handbook' is not one of yours"
    trainer.start = (400, {"error": {"type": "invalid_request", "message": message, "param": "collection"}})
    open_panel(page, site, "handbook")
    page.get_by_role("button", name="Start").click()
    page.get_by_role("alert").filter(has_text=message).wait_for()
    assert trainer.posted[0]["base_model"] == "ft-emb-mine"
    assert page.locator("#tune-run").is_hidden()
    assert page.get_by_role("button", name="Start").is_enabled()

    trainer.start = (201, {"id": "ftjob-t1", "type": "embedder", "status": "queued"})
    trainer.job = job("failed", 4, error="CUDA out of memory")
    page.get_by_role("button", name="Start").click()
    page.get_by_role("alert").filter(has_text="Tuning failed: CUDA out of memory").wait_for()
    assert page.locator("#tune-error").inner_text() == ""
    assert page.locator("#tune-status").inner_text() == "Status: failed · step 4 of 10"
    assert len(trainer.posted) == 2
    assert json.dumps(trainer.posted[1], sort_keys=True) == json.dumps(trainer.posted[0], sort_keys=True)
    assert re.search(r"#/documents/handbook$", page.url)
