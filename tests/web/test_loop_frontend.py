"""The learning loop's front end (issue 13) in a real browser against doubles of the APIs.

Feedback under answers (thumbs, edit, regenerate and choose), the model picker and its
per-conversation memory, the feedback page (list, filters, counts, delete, train on
feedback followed to the published adapter, a 400 shown), and the held-out evaluation on
the training page. Served over real HTTP from services/agent/web/dist; the websocket is a
scripted Starlette double, the REST APIs Playwright-routed doubles (as in test_frontend.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from starlette.websockets import WebSocket, WebSocketDisconnect

from tests.conftest import REPO_ROOT
from tests.web.test_frontend import BASE_ROUTES, double_api, serve_site, sign_in

SHOTS = REPO_ROOT / "test-artifacts"
SHOTS.mkdir(parents=True, exist_ok=True)
MSG = "msg_" + "a" * 24
DRAFT = "msg_" + "b" * 24
EVIL = "<img src=x onerror=\"window.__pwned='x'\">"

MODELS = {
    "object": "list",
    "data": [
        {
            "id": "SmolLM2-135M-Instruct",
            "kind": "base",
            "owned_by": "tandem",
            "root": "SmolLM2-135M-Instruct",
        },
        {"id": "ft-acme-kto-1", "kind": "adapter", "owned_by": "acme", "parent": "SmolLM2-135M-Instruct"},
        # Listed by the inference service too, but they cannot answer: not in the picker.
        {"id": "all-MiniLM-L6-v2", "kind": "embedding", "owned_by": "tandem"},
        {"id": "tiny-reranker", "kind": "rerank", "owned_by": "tandem"},
    ],
}

WS_FRAMES: list[dict[str, Any]] = []


async def chat_double(ws: WebSocket) -> None:
    """A /v1/ws/chat that answers each frame with a turn whose `done` carries a message_id."""
    await ws.accept(subprotocol="tandem.bearer")
    try:
        while True:
            frame = json.loads(await ws.receive_text())
            WS_FRAMES.append(frame)
            await ws.send_json({"type": "conversation", "conversation_id": "conv-1"})
            await ws.send_json({"type": "token", "text": "Staff get **25 days** of leave."})
            await ws.send_json(
                {"type": "done", "conversation_id": "conv-1", "citations": [], "message_id": MSG}
            )
    except WebSocketDisconnect:
        return


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    with serve_site(chat_double) as url:
        yield url


def body_of(req: Any) -> Any:
    return json.loads(req.post_data or "null")


def stream_route(page: Any, path: str, events: list[dict[str, Any]], calls: list[Any] | None = None) -> None:
    """Answer POST `path` with the events as server-sent events (as the agent streams a turn)."""

    def handle(route: Any) -> None:
        req = route.request
        if calls is not None:
            calls.append((req.method, urlsplit(req.url).path, body_of(req)))
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
        route.fulfill(status=200, content_type="text/event-stream", body=body)

    # Registered after double_api's catch-all, so it is asked first.
    page.route(re.compile(rf".*{re.escape(path)}$"), handle)


def test_thumbs_edit_regenerate_and_model_picker_on_a_streamed_answer(page: Any, site: str) -> None:
    WS_FRAMES.clear()
    calls: list[tuple[str, str, Any]] = []

    def log(status: int, answer: Any) -> Any:
        def handler(req: Any) -> tuple[int, Any]:
            calls.append((req.method, urlsplit(req.url).path, body_of(req)))
            return status, answer

        return handler

    double_api(
        page,
        {
            **BASE_ROUTES,
            r"GET /api/inference/v1/models": lambda r: (200, MODELS),
            r"POST /v1/feedback": log(200, {"message_id": MSG, "rating": 1}),
            rf"DELETE /v1/feedback/{MSG}": log(200, {"message_id": MSG, "deleted": True}),
            rf"POST /v1/messages/{DRAFT}/choose": log(200, {"chosen": DRAFT, "rejected": MSG}),
        },
    )
    stream_route(
        page,
        f"/v1/messages/{MSG}/regenerate",
        [
            {"type": "token", "text": "Everyone gets *thirty* "},
            {"type": "token", "text": f"days [1]. {EVIL}"},
            {
                "type": "citation",
                "index": 1,
                "document_id": "leave",
                "title": "Leave policy",
                "text": "30 days.",
            },
            {"type": "done", "message_id": DRAFT, "draft_of": MSG, "citations": []},
        ],
        calls,
    )
    sign_in(page, site)
    # The picker lists the base model and the tenant's fine-tune, apart.
    picker = page.get_by_label("Model", exact=True)
    page.locator("#chat-model optgroup[label='Fine-tunes'] option").wait_for(state="attached")
    assert picker.locator("optgroup[label='Base models'] option").all_inner_texts() == [
        "SmolLM2-135M-Instruct"
    ]
    assert picker.locator("optgroup[label='Fine-tunes'] option").all_inner_texts() == ["ft-acme-kto-1"]
    picker.select_option("ft-acme-kto-1")
    page.get_by_label("Collection").select_option("handbook")
    page.get_by_label("Message", exact=True).fill("How much leave?")
    page.keyboard.press("Enter")
    answer = page.locator(f".msg.assistant[data-message-id='{MSG}']")
    answer.wait_for()
    assert WS_FRAMES[0] == {
        "pipeline": "chat-documents",
        "message": "How much leave?",
        "collection": "handbook",
        "llm": "ft-acme-kto-1",
    }

    up = answer.get_by_role("button", name="Good answer")
    down = answer.get_by_role("button", name="Bad answer")
    assert up.get_attribute("aria-pressed") == "false"
    up.click()
    page.wait_for_function("document.querySelector('.thumb-up').getAttribute('aria-pressed') === 'true'")
    assert calls[-1] == ("POST", "/v1/feedback", {"message_id": MSG, "rating": 1})
    # Down replaces up; pressing down again withdraws the rating.
    down.click()
    page.wait_for_function("document.querySelector('.thumb-down').getAttribute('aria-pressed') === 'true'")
    assert up.get_attribute("aria-pressed") == "false"
    assert calls[-1] == ("POST", "/v1/feedback", {"message_id": MSG, "rating": -1})
    down.click()
    page.wait_for_function("document.querySelector('.thumb-down').getAttribute('aria-pressed') === 'false'")
    assert calls[-1] == ("DELETE", f"/v1/feedback/{MSG}", None)

    # Edit answer: the textarea starts from the answer; saving sends a correction with rating -1.
    answer.get_by_role("button", name="Edit answer").click()
    box = page.get_by_label("Corrected answer")
    assert box.input_value() == "Staff get **25 days** of leave."
    correction = f"Staff get 30 days of leave [1]. {EVIL}"
    box.fill(correction)
    page.get_by_role("button", name="Save correction").click()
    answer.locator(".correction-text").wait_for()
    assert calls[-1] == ("POST", "/v1/feedback", {"message_id": MSG, "rating": -1, "correction": correction})
    assert answer.locator(".correction-text").inner_text() == correction
    assert down.get_attribute("aria-pressed") == "true"
    assert page.get_by_label("Corrected answer").count() == 0

    # Regenerate: two drafts side by side; choosing the second records it over the first.
    answer.get_by_role("button", name="Regenerate").click()
    drafts = page.locator(".drafts .draft")
    page.locator(f".draft[data-message-id='{DRAFT}'][aria-busy='false']").wait_for()
    assert calls[-1] == ("POST", f"/v1/messages/{MSG}/regenerate", {"stream": True})
    first, second = drafts.nth(0).bounding_box(), drafts.nth(1).bounding_box()
    assert abs(first["y"] - second["y"]) < 2 and second["x"] > first["x"] + first["width"] - 1
    assert drafts.nth(0).locator(".md").inner_text() == "Staff get 25 days of leave."
    assert drafts.nth(1).locator("em").inner_text() == "thirty"
    assert drafts.nth(1).locator(".cite-ref").inner_text() == "[1]"
    assert drafts.nth(1).locator(".chip").inner_text().endswith("Leave policy")
    page.screenshot(path=str(SHOTS / "chat-feedback-drafts.png"), full_page=True)
    page.get_by_role("button", name="Choose draft 2").click()
    page.locator(".draft.chosen").wait_for()
    assert calls[-1] == ("POST", f"/v1/messages/{DRAFT}/choose", {"over": MSG})
    assert page.locator(".draft.chosen").get_attribute("data-message-id") == DRAFT
    assert page.get_by_role("button", name="Choose draft 1").is_disabled()
    # Untrusted answer and correction text stayed text.
    assert page.locator(".messages img, .messages [onerror]").count() == 0
    assert page.evaluate("window.__pwned === undefined")
    assert page.page_errors == []


def test_a_reopened_conversation_keeps_its_model_and_its_feedback(page: Any, site: str) -> None:
    WS_FRAMES.clear()
    conv = {
        "id": "conv-1",
        "llm": "ft-acme-kto-1",
        "messages": [
            {"role": "user", "content": "How much leave?"},
            {"role": "assistant", "content": "25 days.", "message_id": MSG, "feedback": {"rating": 1}},
            {"role": "user", "content": "And sick days?"},
            {"role": "assistant", "content": "Ten.", "message_id": DRAFT},
            {"role": "assistant", "content": "An old answer with no id."},
        ],
    }
    double_api(
        page,
        {
            **BASE_ROUTES,
            r"GET /v1/conversations": lambda r: (200, {"data": [{"id": "conv-1", "title": "Leave"}]}),
            r"GET /v1/conversations/conv-1": lambda r: (200, conv),
            r"GET /api/inference/v1/models": lambda r: (200, MODELS),
        },
    )
    sign_in(page, site)
    picker = page.get_by_label("Model", exact=True)
    assert picker.input_value() == ""  # a new conversation starts on the pipeline's model
    page.goto(f"{site}/#/chat/conv-1")
    page.locator(f"[data-message-id='{DRAFT}']").wait_for()
    page.wait_for_function("document.querySelector('#chat-model').value === 'ft-acme-kto-1'")
    first = page.locator(f"[data-message-id='{MSG}']")
    assert first.get_by_role("button", name="Good answer").get_attribute("aria-pressed") == "true"
    assert page.locator(".answer-actions:not([hidden])").count() == 2  # the id-less answer has none
    # A regenerate the agent refuses says why, and offers nothing to choose.
    page.locator(f"[data-message-id='{DRAFT}']").get_by_role("button", name="Regenerate").click()
    failed = page.locator(".drafts-status[role='alert']")
    failed.wait_for()
    assert failed.inner_text() == "Regenerate failed: no double for /v1/messages/" + DRAFT + "/regenerate"
    assert page.get_by_role("button", name="Choose draft 1").is_disabled()
    page.get_by_label("Message", exact=True).fill("And parental leave?")
    page.keyboard.press("Enter")
    page.locator(".msg.assistant[aria-busy='false']").nth(3).wait_for()
    assert WS_FRAMES[-1]["llm"] == "ft-acme-kto-1"
    assert WS_FRAMES[-1]["conversation_id"] == "conv-1"


def feedback_rows() -> list[dict[str, Any]]:
    rows = []
    for i in range(25):
        good = i % 3 != 0
        rows.append(
            {
                "message_id": f"msg_{i:024x}",
                "rating": 1 if good else -1,
                "correction": None if good else f"The right answer {i} {EVIL}",
                "comment": None,
                "pipeline": "chat-documents",
                "model": "SmolLM2-135M-Instruct" if i < 20 else "ft-acme-kto-1",
                "collection": "handbook",
                "question": f"Question {i}?",
                "answer": f"Answer {i} <script>window.__pwned='a'</script>",
                "created_at": 1_764_000_000 + i,
                "updated_at": 1_764_000_000 + i,
            }
        )
    return rows


class FeedbackStore:
    """The agent's feedback routes over a list, with its filters and paging."""

    def __init__(self) -> None:
        self.rows = feedback_rows()
        self.queries: list[dict[str, list[str]]] = []
        self.deleted: list[str] = []

    def list(self, req: Any) -> tuple[int, Any]:
        q = parse_qs(urlsplit(req.url).query)
        self.queries.append(q)
        rows = self.rows
        if "model" in q:
            rows = [r for r in rows if r["model"] == q["model"][0]]
        if "rating" in q:
            rows = [r for r in rows if r["rating"] == int(q["rating"][0])]
        limit, offset = int(q.get("limit", ["50"])[0]), int(q.get("offset", ["0"])[0])
        page = rows[offset : offset + limit]
        return 200, {
            "object": "list",
            "data": page,
            "total": len(rows),
            "has_more": offset + limit < len(rows),
        }

    def stats(self, req: Any) -> tuple[int, Any]:
        out: dict[str, dict[str, Any]] = {}
        for r in self.rows:
            s = out.setdefault(
                r["model"], {"model": r["model"], "up": 0, "down": 0, "corrections": 0, "preferences": 0}
            )
            s["up" if r["rating"] == 1 else "down"] += 1
            s["corrections"] += bool(r["correction"])
        return 200, {"data": list(out.values())}

    def delete(self, req: Any) -> tuple[int, Any]:
        mid = urlsplit(req.url).path.rsplit("/", 1)[1]
        self.deleted.append(mid)
        self.rows = [r for r in self.rows if r["message_id"] != mid]
        return 200, {"message_id": mid, "deleted": True}

    def routes(self) -> dict[str, Any]:
        return {
            r"GET /v1/feedback(\?.*)?": self.list,
            r"GET /v1/feedback/stats": self.stats,
            r"DELETE /v1/feedback/msg_\w+": self.delete,
        }


def test_feedback_page_lists_filters_pages_counts_and_deletes(page: Any, site: str) -> None:
    store = FeedbackStore()
    double_api(page, {**BASE_ROUTES, **store.routes()})
    page.on("dialog", lambda d: d.accept())
    sign_in(page, site)
    page.get_by_role("link", name="Feedback").click()
    page.wait_for_url(re.compile(r".*#/feedback$"))
    items = page.locator(".fb-item")
    items.first.wait_for()
    assert page.title() == "Feedback · Tandem"
    # Counts per model, the busiest model first.
    base = page.locator(".stats-table tr[data-model='SmolLM2-135M-Instruct']")
    assert [base.locator(c).inner_text() for c in (".up", ".down", ".corrections")] == ["13", "7", "7"]
    assert page.locator(".stats-table tbody tr").first.get_attribute("data-model") == "SmolLM2-135M-Instruct"
    assert items.count() == 20
    assert page.locator("#fb-page-info").inner_text() == "1–20 of 25"
    page.get_by_role("button", name="Next").click()
    page.wait_for_function("document.querySelector('#fb-page-info').textContent === '21–25 of 25'")
    assert store.queries[-1]["offset"] == ["20"] and store.queries[-1]["limit"] == ["20"]
    assert page.get_by_role("button", name="Next").is_disabled()

    # Filters go to the server and start again at the first page.
    page.get_by_label("Rating").select_option("-1")
    page.wait_for_function("document.querySelector('#fb-page-info').textContent === '1–9 of 9'")
    assert store.queries[-1] == {"limit": ["20"], "offset": ["0"], "rating": ["-1"]}
    assert items.count() == 9 and page.locator(".fb-item.good").count() == 0
    page.locator("#fb-filter-model").select_option("ft-acme-kto-1")
    page.wait_for_function("document.querySelector('#fb-page-info').textContent === '1–2 of 2'")
    assert store.queries[-1]["model"] == ["ft-acme-kto-1"]
    assert items.first.locator(".fb-correction").inner_text() == f"Correction: The right answer 21 {EVIL}"

    # Delete one: gone from the list and from the counts.
    items.first.get_by_role("button", name=re.compile("Delete feedback on “Question 21")).click()
    page.wait_for_function("document.querySelector('#fb-page-info').textContent === '1–1 of 1'")
    assert store.deleted == [f"msg_{21:024x}"]
    page.wait_for_function(
        "document.querySelector(\".stats-table tr[data-model='ft-acme-kto-1'] .down\").textContent === '1'"
    )
    assert page.locator(".fb-list script, .fb-list img").count() == 0
    assert page.evaluate("window.__pwned === undefined")
    assert page.page_errors == []


def test_train_on_feedback_follows_the_job_to_the_published_adapter(page: Any, site: str) -> None:
    store = FeedbackStore()
    started: list[Any] = []
    polls = {"n": 0}
    states: list[dict[str, Any]] = [
        {"status": "queued"},
        {"status": "running", "progress": {"step": 1, "total": 3}},
        {"status": "running", "progress": {"step": 2, "total": 3}},
        {
            "status": "succeeded",
            "progress": {"step": 3, "total": 3},
            "fine_tuned_model": "ft-acme-kto-2",
            "published": True,
            "metrics": {
                "loss": 0.41,
                "eval_loss_before": 0.6931,
                "eval_loss_after": 0.5012,
                "eval_accuracy_before": 0.5,
                "eval_accuracy_after": 0.75,
                "eval_margin_before": 0.0,
                "eval_margin_after": 0.42,
            },
        },
    ]
    models = {"data": list(MODELS["data"])}

    def train(req: Any) -> tuple[int, Any]:
        started.append(body_of(req))
        job = {"id": "job-7", "type": "kto", "base_model": "SmolLM2-135M-Instruct", "status": "queued"}
        return 200, {
            "dataset": {
                "file_id": "file-3",
                "format": "kto",
                "rows": 31,
                "counts": {"desirable": 22, "undesirable": 9},
            },
            "job": job,
        }

    def job(req: Any) -> tuple[int, Any]:
        # Each read of the job moves it one state on: the page must keep reading to the end.
        state = states[min(polls["n"], len(states) - 1)]
        polls["n"] += 1
        if state["status"] == "succeeded" and all(m["id"] != "ft-acme-kto-2" for m in models["data"]):
            models["data"].append({"id": "ft-acme-kto-2", "kind": "adapter", "owned_by": "acme"})
        return 200, {"id": "job-7", "type": "kto", "base_model": "SmolLM2-135M-Instruct", **state}

    metrics = {"data": [{"step": 1, "loss": 0.69}, {"step": 2, "loss": 0.55}, {"step": 3, "loss": 0.41}]}
    double_api(
        page,
        {
            **BASE_ROUTES,
            **store.routes(),
            r"POST /v1/feedback/train": train,
            r"GET /api/trainer/v1/jobs/job-7": job,
            r"GET /api/trainer/v1/jobs/job-7/metrics": lambda r: (200, metrics),
            r"GET /api/inference/v1/models": lambda r: (200, models),
        },
    )
    sign_in(page, site)
    page.goto(f"{site}/#/feedback")
    page.locator(".fb-item").first.wait_for()
    assert page.get_by_label("Format").input_value() == "auto"  # the agent picks KTO or DPO
    assert page.locator("#train-model").input_value() == "SmolLM2-135M-Instruct"
    page.get_by_role("button", name="Train on feedback").click()
    result = page.locator("#train-result .adapter-name")
    result.wait_for(timeout=30_000)
    assert started == [{"format": "auto", "model": "SmolLM2-135M-Instruct"}]
    assert result.inner_text() == "ft-acme-kto-2"
    assert "model picker" in page.locator("#train-result").inner_text()
    assert page.locator("#train-status").get_attribute("data-status") == "succeeded"
    assert "31 rows" in page.locator("#train-dataset").inner_text()
    assert polls["n"] >= 4
    page.wait_for_function("document.querySelectorAll('#train-chart .point').length === 3")
    assert page.locator(".eval-table tr[data-metric='accuracy'] .after").inner_text() == "75.0%"
    assert page.get_by_role("button", name="Train on feedback").is_enabled()
    page.screenshot(path=str(SHOTS / "feedback-page.png"), full_page=True)

    # The adapter is in the chat page's model picker.
    page.get_by_role("link", name="chat with it").click()
    page.locator("#chat-model option[value='ft-acme-kto-2']").wait_for(state="attached")
    assert page.page_errors == []


def test_train_on_feedback_shows_a_400_and_a_failed_job(page: Any, site: str) -> None:
    store = FeedbackStore()
    answers: list[tuple[int, Any]] = [
        (
            400,
            {
                "error": {
                    "type": "invalid_request_error",
                    "message": "too little feedback for dpo: 1 preference pair found, 8 needed",
                    "param": "format",
                }
            },
        ),
        (
            200,
            {
                "dataset": {"file_id": "f", "rows": 12, "counts": {}},
                "job": {"id": "job-9", "status": "queued"},
            },
        ),
    ]
    sent: list[Any] = []

    def train(req: Any) -> tuple[int, Any]:
        sent.append(body_of(req))
        return answers.pop(0)

    double_api(
        page,
        {
            **BASE_ROUTES,
            **store.routes(),
            r"POST /v1/feedback/train": train,
            r"GET /api/trainer/v1/jobs/job-9": lambda r: (
                200,
                {"id": "job-9", "type": "dpo", "status": "failed", "error": "CUDA is not available <b>x</b>"},
            ),
            r"GET /api/trainer/v1/jobs/job-9/metrics": lambda r: (200, {"data": []}),
        },
    )
    sign_in(page, site)
    page.evaluate("sessionStorage.removeItem('tandem.feedback.job')")
    page.goto(f"{site}/#/feedback")
    page.locator(".fb-item").first.wait_for()
    page.get_by_label("Format").select_option("dpo")
    page.get_by_role("button", name="Train on feedback").click()
    err = page.locator("#train-error")
    page.wait_for_function("document.querySelector('#train-error').textContent.includes('too little')")
    assert err.inner_text() == "too little feedback for dpo: 1 preference pair found, 8 needed"
    assert sent[0]["format"] == "dpo"
    assert page.get_by_role("button", name="Train on feedback").is_enabled()
    assert page.locator(".train-run").is_hidden()

    page.get_by_role("button", name="Train on feedback").click()
    failed = page.locator("#train-result .error")
    failed.wait_for()
    assert failed.inner_text() == "Training failed: CUDA is not available <b>x</b>"
    assert err.inner_text() == ""


def double_training_api(
    page: Any, jobs: list[dict[str, Any]], files: list[dict[str, Any]], created: dict[str, Any]
) -> list[Any]:
    """The trainer's API as the training page sees it: ``jobs`` listed and readable, ``files``
    listed, a POST answered with ``created`` (queued, then readable); returns the POSTed bodies."""
    posted: list[Any] = []

    def create(req: Any) -> tuple[int, Any]:
        posted.append(body_of(req))
        return 201, {**created, "status": "queued"}

    by_id = {j["id"]: j for j in [*jobs, created]}
    double_api(
        page,
        {
            **BASE_ROUTES,
            r"GET /api/trainer/v1/jobs": lambda r: (200, {"data": jobs}),
            r"GET /api/trainer/v1/jobs/[\w-]+/metrics": lambda r: (200, {"data": [{"step": 1, "loss": 0.5}]}),
            r"GET /api/trainer/v1/jobs/[\w-]+": lambda r: (
                200,
                by_id[urlsplit(r.url).path.rsplit("/", 1)[1]],
            ),
            r"GET /api/trainer/v1/files": lambda r: (200, {"data": files}),
            r"POST /api/trainer/v1/jobs": create,
            r"GET /api/inference/v1/models": lambda r: (200, MODELS),
        },
    )
    return posted


def eval_rows(page: Any, url: str) -> dict[str, list[str]]:
    """The held-out evaluation table of the job page at ``url``: metric -> [before, after, trend]."""
    page.goto(url)
    table = page.locator("#eval-metrics .eval-table")
    table.wait_for()
    return {
        r.get_attribute("data-metric"): [r.locator(c).inner_text() for c in (".before", ".after", ".trend")]
        for r in table.locator("tbody tr").all()
    }


def test_training_page_shows_eval_metrics_beside_the_chart_and_new_job_types(page: Any, site: str) -> None:
    job = {
        "id": "job-e",
        "type": "kto",
        "base_model": "SmolLM2-135M-Instruct",
        "status": "succeeded",
        "progress": {"step": 4, "total": 4},
        "metrics": {
            "loss": 0.3,
            "eval_loss_before": 0.6931,
            "eval_loss_after": 0.7204,
            "eval_accuracy_before": 0.5,
            "eval_accuracy_after": 0.8125,
            "eval_margin_before": 0.0,
            "eval_margin_after": 0.3311,
        },
    }
    plain = {**job, "id": "job-p", "type": "sft", "metrics": {"loss": 0.2}}
    files = [{"id": "file-k", "filename": "fb.jsonl", "rows": 30, "format": "kto", "kinds": ["kto"]}]
    posted = double_training_api(page, [job, plain], files, {**plain, "id": "job-new"})
    sign_in(page, site)
    assert eval_rows(page, f"{site}/#/training/job-e") == {
        "loss": ["0.6931", "0.7204", "worse"],
        "accuracy": ["50.0%", "81.3%", "better"],
        "margin": ["0.0000", "0.3311", "better"],
    }
    # Beside the loss chart, not under it (at desktop width).
    chart, box = page.locator("#loss-chart").bounding_box(), page.locator("#eval-metrics").bounding_box()
    assert box["x"] >= chart["x"] + chart["width"] - 1 and abs(box["y"] - chart["y"]) < 40
    assert "eval_" not in page.locator(".job-detail p.small.muted").inner_text()
    # A job without held-out metrics shows none.
    page.goto(f"{site}/#/training/job-p")
    page.wait_for_function("document.querySelector('.job-status')?.dataset.status === 'succeeded'")
    assert page.locator("#eval-metrics").is_hidden()

    types = page.locator("#job-type option").evaluate_all("os => os.map(o => o.value)")
    assert {"kto", "simpo", "orpo"} <= set(types)
    page.get_by_label("Type").select_option("kto")
    page.get_by_label("Held-out share").fill("0.6")
    page.get_by_role("button", name="Start training").click()
    page.get_by_role("alert").filter(has_text="Held-out share").wait_for()
    assert posted == []
    page.get_by_label("Held-out share").fill("0.1")
    page.get_by_role("button", name="Start training").click()
    page.wait_for_url(re.compile(r".*#/training/job-new$"))
    assert posted[0]["type"] == "kto" and posted[0]["eval_fraction"] == 0.1
    assert posted[0]["dataset"] == "file-k"


@pytest.mark.parametrize("page", [{"width": 390, "height": 844}], indirect=True)
def test_feedback_page_and_drafts_fit_a_phone(page: Any, site: str) -> None:
    store = FeedbackStore()
    double_api(
        page,
        {
            **BASE_ROUTES,
            **store.routes(),
            r"GET /api/inference/v1/models": lambda r: (200, MODELS),
        },
    )
    stream_route(
        page,
        f"/v1/messages/{MSG}/regenerate",
        [
            {"type": "token", "text": "Thirty days " * 30},
            {"type": "done", "message_id": DRAFT, "citations": []},
        ],
    )
    sign_in(page, site)
    page.get_by_label("Message", exact=True).fill("How much leave?")
    page.keyboard.press("Enter")
    page.locator(f"[data-message-id='{MSG}']").get_by_role("button", name="Regenerate").click()
    page.locator(".drafts .draft").nth(1).wait_for()
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    page.goto(f"{site}/#/feedback")
    page.locator(".fb-item").first.wait_for()
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    unlabeled = page.evaluate(
        """() => [...document.querySelectorAll('input:not([type=hidden]), select, textarea')]
            .filter(el => !(el.labels && el.labels.length) && !el.getAttribute('aria-label'))
            .map(el => el.id || el.outerHTML.slice(0, 60))"""
    )
    assert unlabeled == []
