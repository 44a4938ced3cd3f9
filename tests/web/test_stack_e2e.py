"""The web front end in Debian's chromium against the real embedded stack (`tandem up`).

One stack per module in a temp TANDEM_HOME on free ports; `tandem down` afterwards.
Each test drives the page as a person would and saves a screenshot under
test-artifacts/web/. A route a test needs that the stack does not serve fails the test,
naming the route.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.servers import free_port
from tests.helpers.waiting import wait_until
from tests.web.conftest import ARTIFACTS

pytestmark = pytest.mark.e2e
TANDEM = [sys.executable, "-m", "services.cli.main"]

FACT_DOC = (
    "# Harbor Lighthouse\n\n"
    "## History\n\n"
    "The Harbor Lighthouse was built in 1887 by the engineer Mara Quillfeather. "
    "Its lamp burned whale oil until 1923, when it was converted to electricity.\n\n"
    "## Visiting\n\n"
    "The lighthouse is open to visitors on Saturdays from 10:00 to 16:00. "
    "Tickets cost 4 euros; children under twelve enter free.\n"
)


@dataclass
class Stack:
    url: str  # the agent: web front end, /v1, and /api/<service> proxies
    key: str
    env: dict[str, str]
    retrieval_url: str

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=300)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("web-stack") / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    ports = {
        f"TANDEM_{s}_PORT": str(free_port()) for s in ("REDIS", "AGENT", "INFERENCE", "RETRIEVAL", "TRAINER")
    }
    env.update(ports, TANDEM_HOME=str(home), TANDEM_DEVICE="cpu", TANDEM_LOG_JSON="false")
    # Uploads over 1 KiB become ingestion jobs, so the upload test sees both paths (the PDF is ~1.4 KiB).
    env["TANDEM_RETRIEVAL_ASYNC_UPLOAD_KB"] = "1"
    up = subprocess.run(
        [*TANDEM, "up", "--timeout", "600"], env=env, capture_output=True, text=True, timeout=900
    )
    try:
        if up.returncode != 0:
            logs = "\n".join(
                f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                for p in sorted((home / "logs").glob("*.log"))
            )
            pytest.fail(f"`tandem up` failed:\n{up.stdout}\n{up.stderr}\n{logs}")
        yield Stack(
            url=f"http://127.0.0.1:{ports['TANDEM_AGENT_PORT']}",
            key=(home / "api-key").read_text().strip(),
            env=env,
            retrieval_url=f"http://127.0.0.1:{ports['TANDEM_RETRIEVAL_PORT']}",
        )
    finally:
        subprocess.run([*TANDEM, "down"], env=env, capture_output=True, text=True, timeout=180)


def need(stack: Stack, method: str, path: str, what: str, **kwargs: Any) -> httpx.Response:
    """Fails (naming the route) when `path` is not served: FastAPI's bare 404/405, not a Tandem error."""
    with stack.client() as c:
        resp = c.request(method, path, **kwargs)
    if resp.status_code in (404, 405):
        try:
            body = resp.json()
        except ValueError:
            body = {}
        assert "error" in body, (
            f"{what} is not served: {method} {path} answers {resp.status_code} {resp.text[:80]}"
        )
    return resp


def sign_in(page: Any, stack: Stack) -> None:
    page.goto(f"{stack.url}/#/signin")
    page.get_by_label("API key").fill(stack.key)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r".*#/chat$"))


@pytest.fixture(scope="module")
def facts(stack: Stack) -> str:
    """A collection holding FACT_DOC, made through the agent's retrieval proxy."""
    need(stack, "GET", "/api/retrieval/v1/collections", "the retrieval collections API (issue 3)")
    name = "facts"
    with stack.client() as c:
        made = c.post("/api/retrieval/v1/collections", json={"name": name})
        assert made.status_code in (200, 201, 409), made.text
        sent = c.post(
            f"/api/retrieval/v1/collections/{name}/documents",
            json={
                "documents": [
                    {
                        "id": "lighthouse",
                        "title": "Harbor Lighthouse",
                        "text": FACT_DOC,
                        "metadata": {"lang": "en", "year": 1887},
                    }
                ]
            },
        )
        assert sent.status_code in (200, 201, 202), sent.text
        job = sent.json().get("job_id")
        if job:
            state = wait_until(
                lambda: (
                    (s := c.get(f"/api/retrieval/v1/jobs/{job}").json().get("state"))
                    in ("succeeded", "failed")
                    and s
                ),
                180,
                f"ingestion job {job} ends",
                interval=0.5,
            )
            assert state == "succeeded"
    return name


def test_unauthenticated_visit_lands_on_sign_in(page: Any, stack: Stack) -> None:
    index = httpx.get(f"{stack.url}/", timeout=30)
    assert index.status_code == 200 and "<title>Tandem</title>" in index.text, (
        f"the agent does not serve the web build at / (HTTP {index.status_code})"
    )
    page.goto(f"{stack.url}/#/training")
    page.wait_for_url(re.compile(r".*#/signin.*"))
    assert page.get_by_role("heading", name="Sign in to Tandem").is_visible()
    # Every asset came from the agent's own origin: nothing from a CDN.
    assets = page.evaluate(
        "[...document.querySelectorAll('script[src], link[href]')].map(e => e.src || e.href)"
    )
    assert assets and all(a.startswith(stack.url) or a.startswith("data:") for a in assets), assets


def test_sign_in_with_the_stack_key(page: Any, stack: Stack) -> None:
    need(stack, "GET", "/v1/whoami", "the agent's /v1/whoami")
    page.goto(f"{stack.url}/")
    page.get_by_label("API key").fill("tdm_not_a_key")
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("alert").filter(has_text="not accepted").wait_for()
    page.get_by_label("API key").fill(stack.key)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r".*#/chat$"))
    assert stack.key not in page.url
    assert page.locator("#who").inner_text() == "tenant default"


def make_pdf(path: Path) -> None:
    from reportlab.lib.pagesizes import A4
    from reportlab.pdfgen import canvas

    pdf = canvas.Canvas(str(path), pagesize=A4)
    y = 800
    for line in [
        "Quarterly tide report",
        "The spring tide in March reached 5.2 metres at the Harbor Lighthouse.",
        "Neap tides stayed below 2 metres all quarter.",
    ]:
        pdf.drawString(72, y, line)
        y -= 20
    pdf.showPage()
    pdf.save()


def test_create_collection_and_upload_markdown_and_pdf(page: Any, stack: Stack, tmp_path: Path) -> None:
    need(stack, "GET", "/api/retrieval/v1/collections", "the retrieval collections API (issue 3)")
    need(
        stack,
        "POST",
        "/api/retrieval/v1/collections/x-missing/files",
        "retrieval file uploads",
        files={"file": ("a.md", b"# a")},
    )
    md = tmp_path / "guide.md"
    md.write_text("# Visitor guide\n\nBring a coat: the gallery at the top of the lighthouse is windy.\n")
    pdf = tmp_path / "tides.pdf"
    make_pdf(pdf)
    name = f"uploads-{uuid.uuid4().hex[:6]}"

    sign_in(page, stack)
    page.get_by_role("link", name="Documents").click()
    page.get_by_label("New collection").fill(name)
    page.get_by_role("button", name="Create").click()
    page.wait_for_url(re.compile(rf".*#/documents/{name}$"))
    page.get_by_role("heading", name=f"Collection “{name}”").wait_for()
    page.locator("#file-picker").set_input_files([str(md), str(pdf)])
    for fname in ("guide.md", "tides.pdf"):
        item = page.locator(f"li.upload[data-file='{fname}']")
        item.wait_for()
        page.wait_for_function(
            f"['done', 'error'].includes(document.querySelector(\"li.upload[data-file='{fname}']\").dataset.state)",
            timeout=240_000,
        )
        assert item.get_attribute("data-state") == "done", item.inner_text()
    # The small Markdown file was ingested in the request; the PDF went through a job to the end.
    assert page.locator("li.upload[data-file='guide.md']").get_attribute("data-job") is None
    assert page.locator("li.upload[data-file='tides.pdf']").get_attribute("data-job")
    rows = page.locator("table.docs tbody tr[data-id]")
    page.wait_for_function("document.querySelectorAll('table.docs tbody tr[data-id]').length === 2")
    assert rows.count() == 2

    # A bad file fails on its own line with the service's message; the others are unaffected.
    empty = tmp_path / "empty.md"
    empty.write_text("")
    page.locator("#file-picker").set_input_files([str(empty)])
    page.wait_for_function(
        "document.querySelector(\"li.upload[data-file='empty.md']\")?.dataset.state === 'error'",
        timeout=60_000,
    )
    assert page.locator("li.upload[data-file='empty.md'] .error").inner_text().strip()
    assert rows.count() == 2


def test_chat_streams_an_answer_with_a_citation(page: Any, stack: Stack, facts: str) -> None:
    need(stack, "GET", "/v1/pipelines", "the agent's pipeline catalog (issue 7)")
    need(stack, "GET", "/api/inference/v1/models", "the inference service's OpenAI API (issue 4)")
    sign_in(page, stack)
    # the model writes (and streams) the answer: chat-documents answers with source sentences
    page.get_by_label("Pipeline or agent", exact=True).select_option("chat-documents-generate")
    page.get_by_label("Collection", exact=True).select_option(facts)
    page.get_by_label("Message", exact=True).fill("When was the Harbor Lighthouse built, and by whom?")
    page.keyboard.press("Enter")
    # Streaming: text shows while the answer is still marked busy.
    page.wait_for_function(
        "(() => { const m = document.querySelector('.msg.assistant[aria-busy=\"true\"] .md');"
        " return !!m && m.textContent.trim().length > 0; })()",
        timeout=240_000,
    )
    page.locator(".msg.assistant[aria-busy='false']").wait_for(timeout=240_000)
    answer = page.locator(".msg.assistant").last
    assert not answer.locator(".error").is_visible(), answer.inner_text()
    chips = answer.locator(".chip")
    assert chips.count() >= 1, f"no citation in: {answer.inner_text()}"
    page.wait_for_url(re.compile(r".*#/chat/[^/]+$"))
    page.locator(".conv-link[aria-current='page']").wait_for()
    page.screenshot(path=str(ARTIFACTS / "chat-answer.png"))

    chips.first.click()
    mark = page.locator("dialog mark.cited")
    mark.wait_for()
    cited = mark.inner_text().strip()
    assert cited and cited.split()[0] in FACT_DOC, cited
    # the dialog's own title (the cited document's view below it has headings of its own)
    assert page.get_by_role("dialog").get_by_role("heading", level=2).inner_text().startswith("[")


def test_the_default_pipeline_answers_with_a_cited_source_sentence(
    page: Any, stack: Stack, facts: str
) -> None:
    sign_in(page, stack)
    page.get_by_label("Collection", exact=True).select_option(facts)
    page.get_by_label("Message", exact=True).fill("When was the Harbor Lighthouse built, and by whom?")
    page.keyboard.press("Enter")
    page.locator(".msg.assistant[aria-busy='false']").wait_for(timeout=240_000)
    answer = page.locator(".msg.assistant").last
    assert not answer.locator(".error").is_visible(), answer.inner_text()
    # chat-documents (the default): the source's own sentence, cited, without a model call
    assert answer.locator(".chip").count() >= 1, answer.inner_text()
    assert "1887" in answer.inner_text() and "Quillfeather" in answer.inner_text(), answer.inner_text()


def test_stop_keeps_the_partial_answer(page: Any, stack: Stack, facts: str) -> None:
    need(stack, "GET", "/v1/pipelines", "the agent's pipeline catalog (issue 7)")
    need(stack, "GET", "/api/inference/v1/models", "the inference service's OpenAI API (issue 4)")
    sign_in(page, stack)
    # the model writes (and streams) the answer: chat-documents answers with source sentences
    page.get_by_label("Pipeline or agent", exact=True).select_option("chat-documents-generate")
    page.get_by_label("Collection", exact=True).select_option(facts)
    page.get_by_label("Message", exact=True).fill(
        "Tell me everything about the Harbor Lighthouse, in detail."
    )
    page.keyboard.press("Enter")
    page.wait_for_function(
        "(() => { const m = document.querySelector('.msg.assistant[aria-busy=\"true\"] .md');"
        " return !!m && m.textContent.trim().length > 0; })()",
        timeout=240_000,
    )
    page.get_by_role("button", name="Stop").click()
    page.locator(".msg.assistant[aria-busy='false']").wait_for(timeout=30_000)
    assert page.get_by_role("button", name="Send").is_enabled()
    assert page.get_by_role("button", name="Stop").is_disabled()
    assert page.locator(".msg.assistant .md").last.inner_text().strip()
    assert not page.locator(".msg.assistant .error").last.is_visible()
    # The conversation goes on after a stop.
    page.get_by_label("Message", exact=True).fill("When does it open?")
    page.keyboard.press("Enter")
    page.locator(".msg.assistant[aria-busy='false']").nth(1).wait_for(timeout=240_000)
    assert page.locator(".msg.user").count() == 2

    # Rename the conversation (kept by the agent: it survives a reload), then delete it.
    conv = page.locator(".conv-link[aria-current='page']")
    old_title = conv.inner_text()
    page.get_by_role("button", name=f"Rename “{old_title}”").click()
    page.get_by_label("New title").fill("Lighthouse, stopped early")
    page.get_by_label("New title").press("Enter")
    page.get_by_role("link", name="Lighthouse, stopped early").wait_for()
    page.reload()
    page.get_by_role("link", name="Lighthouse, stopped early").wait_for()
    assert page.locator(".msg.user").count() == 2
    page.once("dialog", lambda d: d.accept())
    page.get_by_role("button", name="Delete “Lighthouse, stopped early”").click()
    page.get_by_role("link", name="Lighthouse, stopped early").wait_for(state="detached")
    page.wait_for_url(re.compile(r".*#/chat$"))


def test_agent_steps_show_as_they_happen(page: Any, stack: Stack) -> None:
    catalog = need(stack, "GET", "/v1/pipelines", "the agent's pipeline catalog (issue 7)").json()["data"]
    agents = [c["id"] for c in catalog if c.get("kind") == "agent"]
    assert agents, f"the agent service lists no agent in GET /v1/pipelines: {catalog}"
    sign_in(page, stack)
    page.get_by_label("Kind").select_option("agent")
    page.get_by_label("Pipeline or agent").select_option(agents[0])
    page.get_by_label("Message", exact=True).fill("What is 37 * 41? Use the calculator.")
    page.keyboard.press("Enter")
    # A step is on the page before the turn is over.
    page.wait_for_function(
        "document.querySelectorAll('.msg.assistant[aria-busy=\"true\"] .step').length > 0", timeout=240_000
    )
    page.locator(".msg.assistant[aria-busy='false']").wait_for(timeout=240_000)
    steps = page.locator(".msg.assistant .step")
    kinds = {c.split("step-")[-1] for c in steps.evaluate_all("els => els.map(e => e.className)")}
    assert kinds & {"thought", "tool_call", "observation", "final"}, kinds


def test_search_highlights_passages(page: Any, stack: Stack, facts: str) -> None:
    need(
        stack,
        "POST",
        f"/api/retrieval/v1/collections/{facts}/search",
        "retrieval search",
        json={"query": "x"},
    )
    sign_in(page, stack)
    page.get_by_role("link", name="Search").click()
    page.get_by_label("Collection", exact=True).select_option(facts)
    for mode in ("hybrid", "sparse", "dense"):
        page.get_by_label("Query").fill("lighthouse tickets Saturdays")
        page.get_by_label(mode, exact=True).check()
        page.get_by_role("button", name="Search", exact=True).click()
        page.get_by_role("status").filter(has_text=f"({mode},").wait_for()
        first = page.locator("ol.results li.result").first
        first.wait_for()
        assert first.locator("mark").count() >= 1
        assert "Harbor Lighthouse" in first.locator("h2").inner_text()
    # Metadata filters: a range that holds keeps the passage, a value that does not removes it.
    page.get_by_text("Metadata filters").click()
    page.get_by_role("button", name="Add filter").click()
    page.get_by_label("Metadata field").fill("year")
    page.get_by_label("Comparison").select_option("lte")
    page.get_by_label("Value", exact=True).fill("1900")
    page.get_by_role("button", name="Search", exact=True).click()
    page.get_by_role("status").filter(has_text=re.compile(r"^[1-9]\d* results? \(")).wait_for()
    page.get_by_role("button", name="Add filter").click()
    page.get_by_label("Metadata field").nth(1).fill("lang")
    page.get_by_label("Value", exact=True).nth(1).fill("xx")
    page.get_by_role("button", name="Search", exact=True).click()
    page.get_by_role("status").filter(has_text="0 results").wait_for()


SFT_ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
        ]
    }
    for a, b in [(2, 3), (4, 4), (7, 1), (6, 3), (5, 5), (9, 2), (3, 8), (1, 1)]
]


def choose_sft_rows(page: Any, tmp_path: Path) -> None:
    """On the training page: the eight SFT rows as the dataset file, checked by the page."""
    data = tmp_path / "sums.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in SFT_ROWS) + "\n")
    page.get_by_label("Dataset file").set_input_files(str(data))
    page.get_by_role("status").filter(has_text="8 rows").wait_for(timeout=60_000)


def test_training_job_draws_a_loss_chart(page: Any, stack: Stack, tmp_path: Path) -> None:
    need(stack, "GET", "/api/trainer/v1/jobs", "the trainer jobs API (issue 6)")
    need(stack, "GET", "/api/trainer/v1/jobs/x-missing/metrics", "the trainer metrics history")
    need(stack, "GET", "/api/inference/v1/models", "the inference service's OpenAI API (issue 4)")
    sign_in(page, stack)
    page.get_by_role("link", name="Training").click()
    choose_sft_rows(page, tmp_path)
    # Unpacked batches of 2 over 8 rows: 4 optimizer steps, so 4 points on the chart.
    page.get_by_label("Max steps").fill("4")
    page.get_by_label("Batch size").fill("2")
    page.get_by_role("checkbox", name="packing").uncheck()
    page.get_by_role("button", name="Start training").click()
    # The first job of a fresh stack waits for the trainer to prepare the base model; a refused
    # job shows its error in the form instead (fail with it rather than wait out the timeout).
    page.wait_for_function(
        "/#\\/training\\/[^/]+$/.test(location.hash)"
        " || !!document.querySelector('p.error[role=alert]')?.textContent.trim()",
        timeout=300_000,
    )
    form_error = page.locator("p.error[role=alert]").first
    assert not (form_error.count() and form_error.inner_text().strip()), form_error.inner_text()
    assert re.search(r"#/training/[^/]+$", page.url), page.url
    # The chart gets points as the job runs (each optimizer step logs a loss).
    page.wait_for_function(
        "document.querySelectorAll('#loss-chart circle.point').length >= 2", timeout=300_000
    )
    status = page.locator(".job-status")
    page.wait_for_function(
        "['succeeded', 'failed', 'cancelled'].includes(document.querySelector('.job-status')?.dataset.status)",
        timeout=300_000,
    )
    assert status.get_attribute("data-status") == "succeeded", page.locator(".job-detail").inner_text()
    assert page.locator("#loss-chart circle.point").count() >= 4
    assert page.locator("#job-cancel").is_disabled()
    # Published: chat with the result straight away.
    box = page.get_by_label("Message", exact=True)
    box.wait_for(timeout=30_000)
    box.fill("What is 2 plus 2?")
    box.press("Enter")
    page.wait_for_function(
        "(() => { const a = document.querySelector('.model-chat .msg.assistant[aria-busy=\"false\"]');"
        " return !!a && a.textContent.trim().length > 0; })()",
        timeout=120_000,
    )
    assert page.locator(".model-chat .msg.assistant .error").count() == 0


def test_training_job_can_be_cancelled(page: Any, stack: Stack, tmp_path: Path) -> None:
    need(stack, "GET", "/api/trainer/v1/jobs", "the trainer jobs API (issue 6)")
    sign_in(page, stack)
    page.goto(f"{stack.url}/#/training")
    choose_sft_rows(page, tmp_path)
    page.get_by_label("Max steps").fill("500")
    page.get_by_label("Batch size").fill("1")
    page.get_by_role("checkbox", name="publish").uncheck()
    page.get_by_role("button", name="Start training").click()
    # The first job of a fresh stack waits for the trainer to prepare the base model.
    page.wait_for_url(re.compile(r".*#/training/[^/]+$"), timeout=300_000)
    page.wait_for_function(
        "document.querySelector('.job-status')?.dataset.status === 'running'", timeout=300_000
    )
    page.get_by_role("button", name="Cancel").click()
    page.wait_for_function(
        "document.querySelector('.job-status')?.dataset.status === 'cancelled'", timeout=120_000
    )


def test_docs_collection_bootstrap(stack: Stack, tmp_path: Path) -> None:
    """bootstrap_docs makes `docs` from README.md + docs/*.md once, and leaves it alone afterwards."""
    need(stack, "GET", "/api/retrieval/v1/collections", "the retrieval collections API (issue 3)")
    from services.cli.bootstrap_docs import ensure_docs_collection

    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# Tandem\n\nTandem is a suite for RAG with its own fine-tuning.\n")
    (tmp_path / "docs" / "web.md").write_text("# Web front end\n\nSign in with an API key.\n")
    first = ensure_docs_collection(stack.retrieval_url, stack.key, root=tmp_path, collection="docs-test")
    assert first.created and first.documents == ["README.md", "docs-web.md"]
    again = ensure_docs_collection(stack.retrieval_url, stack.key, root=tmp_path, collection="docs-test")
    assert not again.created and again.documents == []
    with stack.client() as c:
        page = c.get("/api/retrieval/v1/collections/docs-test/documents").json()
        assert sorted(d["id"] for d in page["documents"]) == ["README.md", "docs-web.md"]
        titles = {d["id"]: d["title"] for d in page["documents"]}
        assert titles["docs-web.md"] == "Web front end"
        hits = c.post(
            "/api/retrieval/v1/collections/docs-test/search", json={"query": "how do I sign in", "top_k": 1}
        ).json()["results"]
        assert hits[0]["document_id"] == "docs-web.md"
