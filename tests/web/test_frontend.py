"""The front end in a real browser against test doubles of the APIs.

These tests are about the page itself (routing, sign-in gate, rendering untrusted text,
the websocket event handling, phone width); the services behind it are doubled with
Playwright's request and websocket routing. The built app is served over real HTTP from
services/agent/web/dist. The same flows against the real stack are in test_stack_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.common.security_headers import SecureStaticFiles
from tests.helpers.servers import serve_app
from tests.web.conftest import DIST

KEY = "tdm_test_0123456789abcdef"

Handler = Callable[[Any], tuple[int, Any]]


# What the websocket double received: (subprotocols offered, frames), reset per test.
WS_LOG: dict[str, Any] = {"protocols": [], "frames": []}


# The one source the chat double cites.
LEAVE_CITE: dict[str, Any] = {
    "index": 1,
    "chunk_id": "k",
    "document_id": "leave",
    "title": "Leave policy",
    "text": "Employees get 25 days of paid leave.",
    "start": 0,
    "end": 36,
}


async def chat_double(ws: WebSocket) -> None:
    """A scripted /v1/ws/chat: checks the page's handshake, answers with every event type."""
    offered = ws.scope.get("subprotocols", [])
    WS_LOG["protocols"].append(offered)
    if offered[:1] != ["tandem.bearer"] or len(offered) != 2:
        await ws.close(code=1008)
        return
    await ws.accept(subprotocol="tandem.bearer")
    try:
        while True:
            frame = json.loads(await ws.receive_text())
            WS_LOG["frames"].append(frame)
            if frame.get("type") == "stop":
                await ws.send_json({"type": "done", "conversation_id": "conv-9", "citations": []})
                continue
            if "guard" in frame.get("message", ""):
                await guarded_answers(ws, frame["message"])
                continue
            await ws.send_json({"type": "conversation", "conversation_id": "conv-9"})
            await ws.send_json({"type": "step", "kind": "thought", "text": "I should search."})
            await ws.send_json(
                {"type": "step", "kind": "tool_call", "tool": "search", "input": {"q": "leave"}}
            )
            for tok in ["Staff get ", "**25 days** ", "of leave [1]."]:
                await ws.send_json({"type": "token", "text": tok})
                await asyncio.sleep(0.05)
            await ws.send_json({"type": "citation", **LEAVE_CITE})
            if "hold" not in frame.get("message", ""):
                await ws.send_json({"type": "done", "conversation_id": "conv-9", "citations": []})
    except WebSocketDisconnect:
        return


async def guarded_answers(ws: WebSocket, message: str) -> None:
    """The groundedness guard's side of the protocol: a degenerate answer reset and replaced by an
    extractive one, or a partly supported answer with an unsupported sentence."""
    cite = LEAVE_CITE
    if "degenerate" in message:
        for tok in ["The answer is: ", "The answer is:"]:
            await ws.send_json({"type": "token", "text": tok})
        await ws.send_json({"type": "reset", "reason": "repeated"})
        for tok in ["Employees get 25 days ", "of paid leave [1]."]:
            await ws.send_json({"type": "token", "text": tok})
        await ws.send_json({"type": "citation", **cite, "kind": "extractive"})
        await ws.send_json(
            {
                "type": "done",
                "conversation_id": "conv-9",
                "citations": [{**cite, "kind": "extractive"}],
                "kind": "extractive",
                "grounding": "repeated",
                "unsupported": [],
            }
        )
        return
    text = "Staff get 25 days of leave [1]. Managers ride unicorns to work."
    await ws.send_json({"type": "token", "text": text})
    await ws.send_json(
        {
            "type": "done",
            "conversation_id": "conv-9",
            "citations": [{**cite, "kind": "cited"}],
            "kind": "generated",
            "grounding": "partial",
            "unsupported": [{"text": "Managers ride unicorns to work.", "start": 32, "end": 63}],
        }
    )


@contextmanager
def serve_site(chat: Callable[[WebSocket], Awaitable[None]]) -> Iterator[str]:
    """The built front end with a double of the agent's websocket at /v1/ws/chat."""
    app = Starlette(routes=[WebSocketRoute("/v1/ws/chat", chat)])
    # The agent's own mount: every front-end test runs under its Content-Security-Policy.
    app.mount("/", SecureStaticFiles(directory=DIST, html=True))
    with serve_app(app) as url:
        yield url


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    with serve_site(chat_double) as url:
        yield url


def double_api(page: Any, routes: dict[str, Handler], seen: list[dict[str, Any]] | None = None) -> None:
    """Answer /v1/** and /api/** from `routes` ("METHOD /path" regex → handler(request))."""

    def handle(route: Any) -> None:
        req = route.request
        path = re.sub(r"^https?://[^/]+", "", req.url)
        if seen is not None:
            seen.append({"method": req.method, "path": path, "headers": req.headers})
        for pattern, handler in routes.items():
            if re.fullmatch(pattern, f"{req.method} {path}"):
                status, body = handler(req)
                route.fulfill(status=status, content_type="application/json", body=json.dumps(body))
                return
        route.fulfill(
            status=404,
            content_type="application/json",
            body=json.dumps({"error": {"type": "not_found", "message": f"no double for {path}"}}),
        )

    page.route(re.compile(r".*/(v1|api)/.*"), handle)


def whoami(req: Any) -> tuple[int, Any]:
    if req.headers.get("authorization") == f"Bearer {KEY}":
        return 200, {"tenant": "acme", "key_id": "test"}
    return 401, {"error": {"type": "unauthorized", "message": "invalid API key"}}


BASE_ROUTES: dict[str, Handler] = {
    r"GET /v1/whoami": whoami,
    r"GET /v1/conversations": lambda r: (200, {"data": []}),
    # The agent's catalog shape (services/agent/runtime.py catalog()).
    r"GET /v1/pipelines": lambda r: (
        200,
        {
            "data": [
                {"id": "chat-documents", "kind": "pipeline:chat"},
                {"id": "semantic-search", "kind": "pipeline:search"},
                {"id": "react", "kind": "agent"},
            ]
        },
    ),
    r"GET /api/retrieval/v1/collections": lambda r: (200, {"collections": [{"name": "handbook"}]}),
}


def sign_in(page: Any, site: str) -> None:
    page.goto(f"{site}/#/signin")
    page.get_by_label("API key").fill(KEY)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r".*#/chat$"))


def test_unauthenticated_visit_lands_on_sign_in(page: Any, site: str) -> None:
    for target in ("/", "/#/documents", "/#/training/job-1"):
        page.goto(f"{site}{target}")
        page.wait_for_url(re.compile(r".*#/signin.*"))
        assert page.get_by_role("heading", name="Sign in to Tandem").is_visible()
        assert page.locator("#topbar").is_hidden()


def test_sign_in_checks_the_key_and_keeps_it_out_of_the_url(page: Any, site: str) -> None:
    seen: list[dict[str, Any]] = []
    double_api(page, BASE_ROUTES, seen)
    page.goto(f"{site}/#/documents")
    page.wait_for_url(re.compile(r".*#/signin\?next=documents"))
    page.get_by_label("API key").fill("tdm_wrong")
    page.get_by_role("button", name="Sign in").click()
    alert = page.get_by_role("alert").filter(has_text="not accepted")
    alert.wait_for()
    assert page.evaluate("sessionStorage.getItem('tandem.apiKey')") is None

    page.get_by_label("API key").fill(KEY)
    page.keyboard.press("Enter")
    page.wait_for_url(re.compile(r".*#/documents$"))
    assert KEY not in page.url
    assert page.evaluate("sessionStorage.getItem('tandem.apiKey')") == KEY
    assert page.evaluate("localStorage.getItem('tandem.apiKey')") is None
    assert page.locator("#who").inner_text() == "tenant acme"
    checks = [s for s in seen if s["path"] == "/v1/whoami"]
    assert checks[-1]["headers"]["authorization"] == f"Bearer {KEY}"
    assert all(KEY not in s["path"] for s in seen)

    # Signing out forgets the key and the gate closes again.
    page.get_by_role("button", name="Sign out").click()
    page.wait_for_url(re.compile(r".*#/signin"))
    assert page.evaluate("sessionStorage.getItem('tandem.apiKey')") is None
    page.goto(f"{site}/#/chat")
    page.wait_for_url(re.compile(r".*#/signin.*"))


EVIL = (
    "Here is **bold** text.\n\n"
    "<script>window.__pwned = 'script'</script>\n\n"
    "<img src=x onerror=\"window.__pwned = 'img'\">\n\n"
    "[click me](javascript:window.__pwned='link') and "
    '<a href="#" onclick="window.__pwned=\'a\'">raw link</a> [1]\n\n'
    "```\n<b>code stays text</b>\n```\n"
)


def test_untrusted_markdown_and_document_text_stay_inert(page: Any, site: str) -> None:
    doc_text = (
        "<img src=x onerror=\"window.__pwned='doc'\"> intro. " + "<script>alert(1)</script> the cited words"
    )
    start = doc_text.index("the cited words")
    citation = {
        "index": 1,
        "chunk_id": "c1",
        "document_id": "evil",
        "title": "<img src=x onerror=\"window.__pwned='title'\">",
        "text": "<script>window.__pwned='chunk'</script> the cited words",
        "start": start,
        "end": start + len("the cited words"),
    }
    routes = {
        **BASE_ROUTES,
        r"GET /v1/conversations": lambda r: (200, {"data": [{"id": "c-1", "title": "<b>evil</b>"}]}),
        r"GET /v1/conversations/c-1": lambda r: (
            200,
            {
                "id": "c-1",
                "messages": [
                    {"role": "user", "content": "<img src=x onerror=\"window.__pwned='user'\">"},
                    {"role": "assistant", "content": EVIL, "citations": [citation]},
                ],
            },
        ),
        r"GET /api/retrieval/v1/collections/handbook/documents/evil": lambda r: (
            200,
            {"id": "evil", "text": doc_text},
        ),
    }
    double_api(page, routes)
    sign_in(page, site)
    page.goto(f"{site}/#/chat/c-1")
    answer = page.locator(".msg.assistant .md")
    answer.wait_for()
    page.wait_for_function("document.querySelector('.msg.assistant .md strong') !== null")
    assert answer.locator("strong").inner_text() == "bold"
    # Raw HTML is shown as text, never as elements.
    assert (
        page.locator(".messages script, .messages img, .messages [onerror], .messages [onclick]").count() == 0
    )
    assert "<script>" in answer.inner_text()
    assert answer.locator("pre code").inner_text().strip() == "<b>code stays text</b>"
    for href in answer.locator("a").evaluate_all("els => els.map(a => a.getAttribute('href'))"):
        assert href is None or not href.lower().startswith("javascript:")
    assert page.locator(".conv-link").inner_text() == "<b>evil</b>"

    # The citation chip opens the document with the cited span marked, as text.
    page.locator(".chip").click()
    dialog = page.get_by_role("dialog")
    dialog.wait_for()
    page.wait_for_function("document.querySelector('mark.cited')?.textContent === 'the cited words'")
    assert dialog.locator("img, script").count() == 0
    assert "<script>alert(1)</script>" in dialog.locator(".passage").inner_text()
    page.keyboard.press("Escape")
    # The inline [1] marker is a button for the same citation.
    page.locator(".cite-ref").click()
    dialog.wait_for()
    page.keyboard.press("Escape")
    assert page.evaluate("window.__pwned === undefined")
    assert page.page_errors == []


def test_chat_streams_websocket_events_and_stops(page: Any, site: str) -> None:
    """The page's side of the /v1/ws/chat protocol: what it sends, and each event type it draws."""
    WS_LOG["protocols"].clear()
    WS_LOG["frames"].clear()
    sent = WS_LOG["frames"]
    conversations: list[dict[str, str]] = []
    routes = {
        **BASE_ROUTES,
        r"GET /v1/conversations": lambda r: (200, {"data": conversations}),
        r"GET /api/retrieval/v1/collections/handbook/documents/leave": lambda r: (404, {}),
    }
    double_api(page, routes)
    sign_in(page, site)
    page.get_by_label("Collection").select_option("handbook")
    conversations.append({"id": "conv-9", "title": "How much leave?"})
    page.get_by_label("Message", exact=True).fill("How much leave?")
    page.keyboard.press("Enter")
    page.locator(".msg.assistant[aria-busy='false']").wait_for()
    assert sent[0] == {"pipeline": "chat-documents", "message": "How much leave?", "collection": "handbook"}
    assert WS_LOG["protocols"][0] == ["tandem.bearer", KEY]
    answer = page.locator(".msg.assistant").last
    assert answer.locator(".md strong").inner_text() == "25 days"
    assert answer.locator(".step").count() == 2
    assert "search" in (answer.locator(".step-tool_call").text_content() or "")
    assert answer.locator(".chip").inner_text().endswith("Leave policy")
    page.wait_for_url(re.compile(r".*#/chat/conv-9$"))
    page.locator(".conv-link[aria-current='page']").wait_for()

    # A follow-up carries the conversation id; Stop sends {"type": "stop"}.
    page.get_by_label("Message", exact=True).fill("hold on, and more?")
    page.get_by_role("button", name="Send").click()
    stop = page.get_by_role("button", name="Stop")
    page.wait_for_function("!document.querySelector('#chat-stop').disabled")
    stop.click()
    page.locator(".msg.assistant[aria-busy='false']").nth(1).wait_for()
    assert sent[1]["conversation_id"] == "conv-9"
    assert sent[2] == {"type": "stop"}
    assert page.get_by_role("button", name="Send").is_enabled()

    # The chip opens the passage; with no document text the chunk itself is marked.
    answer.locator(".chip").click()
    mark = page.locator("dialog mark.cited")
    mark.wait_for()
    assert mark.inner_text() == "Employees get 25 days of paid leave."
    assert page.evaluate("document.activeElement.textContent") == "Close"
    page.keyboard.press("Escape")


@pytest.mark.parametrize("page", [{"width": 390, "height": 844}], indirect=True)
def test_phone_width_has_no_sideways_scroll(page: Any, site: str) -> None:
    double_api(
        page,
        {
            **BASE_ROUTES,
            r"GET /api/trainer/v1/(files|jobs)": lambda r: (200, {"data": []}),
            r"GET /api/inference/v1/models": lambda r: (200, {"data": [{"id": "SmolLM2-135M-Instruct"}]}),
            r"GET /api/retrieval/v1/collections/handbook/documents.*": lambda r: (200, {"documents": []}),
        },
    )
    sign_in(page, site)
    for route in ("#/chat", "#/documents/handbook", "#/search", "#/training"):
        page.goto(f"{site}/{route}")
        page.wait_for_timeout(300)
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"{route} is {width}px wide at phone width"
    # Every form control on the training page has a label.
    unlabeled = page.evaluate(
        """() => [...document.querySelectorAll('input:not([type=hidden]), select, textarea')]
            .filter(el => !(el.labels && el.labels.length) && !el.getAttribute('aria-label'))
            .map(el => el.id || el.name || el.outerHTML.slice(0, 60))"""
    )
    assert unlabeled == []


def test_conversations_rename_and_delete_from_the_keyboard(page: Any, site: str) -> None:
    convs = [{"id": "a1", "title": "First chat"}, {"id": "b2", "title": "Second chat"}]
    calls: list[tuple[str, str, Any]] = []

    def patch(req: Any) -> tuple[int, Any]:
        body = json.loads(req.post_data or "{}")
        calls.append(("PATCH", req.url, body))
        for c in convs:
            if req.url.endswith(f"/{c['id']}"):
                c["title"] = body["title"]
        return 200, {}

    def delete(req: Any) -> tuple[int, Any]:
        calls.append(("DELETE", req.url, None))
        convs[:] = [c for c in convs if not req.url.endswith(f"/{c['id']}")]
        return 204, None

    double_api(
        page,
        {
            **BASE_ROUTES,
            r"GET /v1/conversations": lambda r: (200, {"data": convs}),
            r"GET /v1/conversations/\w+": lambda r: (200, {"id": "a1", "messages": []}),
            r"PATCH /v1/conversations/\w+": patch,
            r"DELETE /v1/conversations/\w+": delete,
        },
    )
    page.on("dialog", lambda d: d.accept())
    sign_in(page, site)
    page.get_by_role("button", name="Rename “First chat”").wait_for()
    page.get_by_role("button", name="Rename “First chat”").focus()
    page.keyboard.press("Enter")
    box = page.get_by_label("New title")
    assert page.evaluate("document.activeElement.getAttribute('aria-label')") == "New title"
    box.fill("Lighthouse questions")
    box.press("Enter")
    page.get_by_role("link", name="Lighthouse questions").wait_for()
    assert calls[0][0] == "PATCH" and calls[0][2] == {"title": "Lighthouse questions"}
    # Escape leaves the title as it was.
    page.get_by_role("button", name="Rename “Second chat”").click()
    page.get_by_label("New title").press("Escape")
    page.get_by_role("link", name="Second chat").wait_for()
    assert len(calls) == 1

    page.get_by_role("button", name="Delete “Second chat”").click()
    page.get_by_role("link", name="Second chat").wait_for(state="detached")
    assert calls[-1][0] == "DELETE" and calls[-1][1].endswith("/v1/conversations/b2")
    assert page.locator(".conv-link").count() == 1


def test_a_late_file_listing_keeps_the_dataset_just_uploaded(page: Any, site: str, tmp_path: Any) -> None:
    """The training page lists files on load; if that answer arrives after an upload made
    meanwhile, the upload stays in the list and stays selected (seen in the stack e2e test
    on a loaded machine: the job form was left without a dataset)."""
    uploaded = {"id": "file-1", "filename": "sums.jsonl", "rows": 8, "format": "messages", "kinds": ["sft"]}
    double_api(
        page,
        {
            **BASE_ROUTES,
            r"GET /api/trainer/v1/jobs": lambda r: (200, {"data": []}),
            r"POST /api/trainer/v1/files": lambda r: (201, uploaded),
            r"GET /api/inference/v1/models": lambda r: (200, {"data": [{"id": "SmolLM2-135M-Instruct"}]}),
        },
    )
    held: list[Any] = []

    def hold_listing(route: Any) -> None:
        if route.request.method == "GET":
            held.append(route)  # answered below, after the upload
        else:
            route.fallback()

    page.route(re.compile(r".*/api/trainer/v1/files$"), hold_listing)
    sign_in(page, site)
    page.goto(f"{site}/#/training")
    data = tmp_path / "sums.jsonl"
    data.write_text(
        '{"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}\n'
    )
    page.get_by_label("Dataset file").set_input_files(str(data))
    page.get_by_role("status").filter(has_text="8 rows").wait_for(timeout=10_000)
    assert page.locator("#job-dataset").input_value() == "file-1"
    assert held, "the page did not list files on load"
    for route in held:
        route.fulfill(status=200, content_type="application/json", body=json.dumps({"data": []}))
    page.wait_for_timeout(300)
    assert page.locator("#job-dataset").input_value() == "file-1"
    assert "sums.jsonl" in page.locator("#job-dataset").inner_text()


def test_front_end_renders_under_its_content_security_policy(page: Any, site: str) -> None:
    """The headers are there, the page works under them, and the CSP really blocks inline script."""
    resp = httpx.get(f"{site}/")
    csp = resp.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert resp.headers["x-frame-options"] == "DENY"
    assert resp.headers["x-content-type-options"] == "nosniff"
    assert resp.headers["referrer-policy"] == "no-referrer"
    assert httpx.get(f"{site}/assets/app.js").headers["content-security-policy"] == csp
    violations: list[str] = []
    page.on("console", lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None)
    double_api(page, BASE_ROUTES)
    sign_in(page, site)
    page.get_by_role("textbox").first.wait_for()
    assert not page.page_errors and not violations, (page.page_errors, violations)
    # an inline script injected into the page does not run
    page.evaluate(
        "() => { const s = document.createElement('script'); s.textContent = 'window.__pwned = 1';"
        " document.body.appendChild(s); }"
    )
    assert page.evaluate("() => window.__pwned") is None


def test_guarded_answers_replace_and_dim(page: Any, site: str) -> None:
    """A reset clears the streamed text (the extractive answer replaces it, with a note); an
    unsupported sentence of a kept answer is dimmed."""
    double_api(page, BASE_ROUTES)
    sign_in(page, site)
    page.get_by_label("Collection").select_option("handbook")
    page.get_by_label("Message", exact=True).fill("guard: degenerate")
    page.keyboard.press("Enter")
    answer = page.locator(".msg.assistant").last
    page.locator(".msg.assistant[aria-busy='false']").wait_for()
    assert answer.locator(".md").inner_text().strip() == "Employees get 25 days of paid leave [1]."
    assert "source sentences" in answer.locator(".grounding-note").inner_text()
    assert answer.locator(".chip").count() == 1

    page.get_by_label("Message", exact=True).fill("guard: partial")
    page.keyboard.press("Enter")
    page.locator(".msg.assistant[aria-busy='false']").nth(1).wait_for()
    second = page.locator(".msg.assistant").nth(1)
    assert second.locator(".md .unsupported").inner_text() == "Managers ride unicorns to work"
    assert second.locator(".grounding-note").is_hidden()
