"""A collection's sources on the Documents page, in a real browser, against the real agent (which
serves the built front end and proxies /api/retrieval) and the real retrieval service, with a
Git repository made by ``git`` in a temporary folder and changed between syncs.

The form's 400 stands next to the field it names; an added source is listed with its branch,
paths and interval; "Sync now" follows the sync job to its counts (added, changed, removed,
failed) and the failed file's error, or to the reason a sync of a repository that is gone
failed; Remove drops the source and its documents. The sync job is
run by its task body here, as the retrieval tests run queued jobs (no Celery worker)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.agent.app import create_app as create_agent
from services.agent.config import AgentSettings
from services.common.config import CommonSettings
from tests.conftest import TEST_CACHE, auth
from tests.helpers.servers import serve_app, wait_ready
from tests.retrieval.conftest import make_tiny_embedder
from tests.web.conftest import DIST


@dataclass
class Served:
    agent: str
    retrieval: str
    retrieval_app: Any
    key: str


@contextmanager
def serve(redis_url: str, home: Path, roots: Path, key: str) -> Iterator[Served]:
    from services.retrieval.app import create_app as create_retrieval
    from services.retrieval.config import RetrievalSettings

    models = TEST_CACHE / "retrieval-models"
    tiny = make_tiny_embedder(models / "tiny-embedder")
    common = CommonSettings(home=home, redis_url=redis_url, log_json=False, model_roots=str(models))
    r_app = create_retrieval(common, RetrievalSettings(embedding_model=str(tiny), source_roots=str(roots)))
    with serve_app(r_app) as r_url:
        wait_ready(r_url)  # the embedder is loaded before the first collection needs it
        a_app = create_agent(
            common.model_copy(update={"retrieval_url": r_url}), AgentSettings(web_dist=str(DIST))
        )
        with serve_app(a_app) as a_url:
            yield Served(a_url, r_url, r_app, key)


def git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=Tandem Test", "-c", "user.email=test@example.com", *args],
        cwd=repo,
        check=True,
        capture_output=True,
    )


def make_repo(repo: Path) -> None:
    (repo / "docs").mkdir(parents=True)
    (repo / "README.md").write_text("# Not followed\n\nOutside the source's paths.\n")
    (repo / "docs" / "leave.md").write_text("# Leave\n\nStaff get 25 days of paid leave a year.\n")
    (repo / "docs" / "travel.md").write_text("# Travel\n\nTrains are booked in second class.\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "first")


@pytest.fixture()
def served(redis_url: str, tmp_path: Path, api_key: str) -> Iterator[Served]:
    roots = tmp_path / "sources"
    make_repo(roots / "handbook")
    with serve(redis_url, tmp_path / "home", roots, api_key) as s:
        with httpx.Client(base_url=s.retrieval, headers=auth(api_key), timeout=300) as c:
            assert c.post("/v1/collections", json={"name": "handbook"}).status_code == 201
        yield s


def run_sync(served: Served, job_id: str) -> None:
    """The io worker's part: run the queued sync job (its Celery task body) here."""
    from services.retrieval.sources.sync import run_sync as run

    app = served.retrieval_app
    # In a thread of its own: the sync runs asyncio, and Playwright's loop owns this thread.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(run, app.state.collections, app.state.jobs, "acme", "handbook", job_id).result()


def sync_now(page: Any, served: Served) -> Any:
    """Click "Sync now", run the job it started, and return the source's last sync once the page
    has followed the job to its end and redrawn the source with it."""
    item = page.locator("li.source").first
    item.get_by_role("button", name=re.compile("^Sync now")).click()
    # the box names the new job once the service has queued it; nothing runs it yet
    box = item.locator(".sync-outcome[data-job]:not([data-ended])")
    box.wait_for()
    job_id = str(box.get_attribute("data-job"))
    page.wait_for_function(
        "id => document.querySelector(`.sync-outcome[data-job='${id}']`)?.dataset.status === 'queued'", job_id
    )
    assert box.inner_text() == "Sync: queued"
    assert item.get_by_role("button", name=re.compile("^Sync now")).is_disabled()
    run_sync(served, job_id)
    last = page.locator(f"li.source .last-sync[data-job='{job_id}']")
    last.wait_for()
    # the ended job is shown once, as the last sync, and the button is back
    assert page.locator(f".sync-outcome[data-job='{job_id}']").count() == 0
    assert page.locator("li.source").get_by_role("button", name=re.compile("^Sync now")).is_enabled()
    return last


def counts(el: Any) -> dict[str, str]:
    return {
        c.get_attribute("data-count"): c.inner_text().split()[-1] for c in el.locator("[data-count]").all()
    }


def test_a_git_source_is_added_synced_as_it_changes_and_removed(
    page: Any, served: Served, tmp_path: Path
) -> None:
    repo = tmp_path / "sources" / "handbook"
    page.goto(f"{served.agent}/#/signin?next=documents")
    page.get_by_label("API key").fill(served.key)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r".*#/documents$"))
    page.goto(f"{served.agent}/#/documents/handbook")
    panel = page.get_by_role("region", name="Sources")
    panel.get_by_text("No sources").wait_for()

    # A folder outside TANDEM_RETRIEVAL_SOURCE_ROOTS: the server's 400 stands by the URL field.
    form = page.get_by_role("form", name="Add a source")
    form.get_by_label("Type").select_option("git")
    outside = f"file://{tmp_path / 'elsewhere'}"
    form.get_by_label("URL").fill(outside)
    form.get_by_role("button", name="Add source").click()
    url_error = page.locator("#source-url-error")
    url_error.wait_for()
    assert str(tmp_path / "elsewhere") in url_error.inner_text()
    assert form.get_by_label("URL").get_attribute("aria-invalid") == "true"
    assert page.locator("#source-error").inner_text() == ""

    form.get_by_label("URL").fill(f"file://{repo}")
    form.get_by_label("Branch").fill("main")
    form.get_by_label("Paths").fill("docs/**")
    form.get_by_label("Interval (minutes)").fill("30")
    form.get_by_role("button", name="Add source").click()
    item = page.locator("li.source")
    item.wait_for()
    assert url_error.inner_text() == "" and form.get_by_label("URL").get_attribute("aria-invalid") is None
    assert item.locator(".source-type").inner_text() == "git"
    assert item.locator(".source-url").inner_text() == f"file://{repo}"
    what = item.locator(".source-what").inner_text()
    assert "branch main" in what and "paths docs/**" in what and "every 30 min" in what
    assert item.locator(".last-sync").inner_text() == "Last sync: never"
    assert item.locator(".next-sync time").count() == 1  # due: the schedule starts it

    last = sync_now(page, served)
    assert last.locator("[data-status]").inner_text() == "succeeded"
    assert counts(last) == {"added": "2", "changed": "0", "removed": "0", "failed": "0"}
    assert "commit" in last.inner_text()
    # the documents it gave are listed, and the source counts them
    page.wait_for_function("document.querySelectorAll('table.docs tbody tr[data-id]').length === 2")
    assert "2 files, 2 documents" in page.locator("li.source .source-what").inner_text()

    # The repository changes: one file edited, one deleted, one added that cannot be parsed.
    (repo / "docs" / "leave.md").write_text("# Leave\n\nStaff get 27 days of paid leave a year.\n")
    (repo / "docs" / "travel.md").unlink()
    (repo / "docs" / "broken.pdf").write_bytes(b"%PDF-1.7\nnot really a PDF\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "second")
    last = sync_now(page, served)
    assert last.locator("[data-status]").inner_text() == "succeeded"  # one file failed, not the sync
    assert counts(last) == {"added": "0", "changed": "1", "removed": "1", "failed": "1"}
    errors = last.locator("details.sync-errors")
    assert errors.locator("summary").inner_text() == "1 file failed"
    assert errors.get_attribute("open") is not None  # few errors: shown unfolded
    assert "docs/broken.pdf" in errors.locator("li").inner_text()
    errors.locator("summary").click()
    assert errors.get_attribute("open") is None
    page.wait_for_function("document.querySelectorAll('table.docs tbody tr[data-id]').length === 1")
    assert "1 file, 1 document" in page.locator("li.source .source-what").inner_text()
    # at phone width the long file:// URL and the error wrap: nothing scrolls sideways
    page.set_viewport_size({"width": 390, "height": 800})
    page.wait_for_function("document.documentElement.scrollWidth <= 390")
    page.set_viewport_size({"width": 1280, "height": 800})

    # The repository is gone: the sync fails, says why, and the collection stays as it was.
    repo.rename(repo.with_name("moved"))
    last = sync_now(page, served)
    assert last.locator("[data-status]").inner_text() == "failed"
    assert last.locator("p.error").inner_text().strip() != ""
    assert page.locator("table.docs tbody tr[data-id]").count() == 1

    # Remove: the source goes, and the documents it gave leave the collection.
    page.once("dialog", lambda d: d.accept())
    page.locator("li.source").get_by_role("button", name=re.compile("^Remove")).click()
    panel.get_by_text("No sources").wait_for()
    page.wait_for_function("document.querySelector('table.docs tbody tr[data-id]') === null")
    assert page.page_errors == []
