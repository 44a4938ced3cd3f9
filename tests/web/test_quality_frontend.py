"""The "Quality" page in a real browser, against the real agent service (which serves the built
front end) over the retrieval and inference doubles: per model over time the figures of
``GET /v1/quality`` beside the thumbs-up rate, and the worst recent answers, one of which opens
its conversation with the answer marked."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from services.common.auth import KeyStore
from tests.agent.stack import Stack, agent_stack
from tests.conftest import auth
from tests.web.conftest import DIST

GOOD_Q = "What is the capital of France?"
WEAK_Q = "What is the capital of Germany?"


@pytest.fixture()
def served(redis_url: str, tmp_path: Any) -> Iterator[Stack]:
    with agent_stack(redis_url, tmp_path / "home", web_dist=str(DIST)) as stack:
        yield stack


@pytest.fixture()
def page_key(key_store: KeyStore) -> str:
    """A tenant of its own: the session's Valkey is shared between tests."""
    return str(key_store.create(f"quality-{uuid.uuid4().hex[:8]}")[0])


def answer(stack: Stack, key: str, question: str, reply: str) -> dict[str, Any]:
    stack.model.replies = lambda body: reply
    resp = httpx.post(
        f"{stack.url}/v1/pipelines/chat-documents-generate/run",
        json={"query": question, "collection": "geo", "remember": True},
        headers=auth(key),
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def rate(stack: Stack, key: str, message_id: str, rating: int) -> None:
    resp = httpx.post(
        f"{stack.url}/v1/feedback",
        json={"message_id": message_id, "rating": rating},
        headers=auth(key),
        timeout=30,
    )
    assert resp.status_code == 200, resp.text


def pct(v: float | None) -> str:
    return "–" if v is None else f"{round(v * 100)}%"


def test_quality_per_model_and_the_worst_answers_open_their_conversation(
    page: Any, served: Stack, page_key: str
) -> None:
    stack, key = served, page_key
    good = answer(stack, key, GOOD_Q, "Paris is the capital of France [1].")
    weak = answer(
        stack, key, WEAK_Q, "Berlin is the capital of Germany [1]. Germany invented the bicycle in 1492."
    )
    rate(stack, key, good["message_id"], 1)
    rate(stack, key, weak["message_id"], -1)
    report = httpx.get(
        f"{stack.url}/v1/quality", params={"bucket": "day"}, headers=auth(key), timeout=30
    ).json()
    points = sorted(report["data"], key=lambda p: -p["start"])
    assert sum(p["answers"] for p in points) == 2

    page.goto(f"{stack.url}/#/signin?next=quality")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r".*#/quality$"))
    assert page.get_by_role("link", name="Quality").get_attribute("aria-current") == "page"

    # -- per model over time: the report's figures, newest period first ---------------------
    model = page.get_by_role("region", name="Quality of scripted")
    model.wait_for()
    rows = model.locator("tbody tr")
    assert rows.count() == len(points)
    for i, p in enumerate(points):
        row = rows.nth(i)
        assert row.locator("td.answers").inner_text() == str(p["answers"])
        assert row.locator("td.groundedness").inner_text() == pct(p["groundedness_mean"])
        assert row.locator("td.cited").inner_text() == pct(p["cited_share"])
        assert row.locator("td.not-found").inner_text() == pct(p["not_found_share"])
        thumbs = f"{pct(p['thumbs_up_rate'])} of {p['rated']}" if p["rated"] else "–"
        assert row.locator("td.thumbs-up").inner_text() == thumbs
    if len(points) == 1:  # both answers in one day (unless the test ran across midnight UTC)
        cells = [rows.first.locator(f"td.{c}").inner_text() for c in ("groundedness", "cited", "thumbs-up")]
        assert cells == ["75%", "100%", "50% of 2"]
    page.get_by_label("Period").select_option("week")
    page.locator("#quality-models th[scope=row]", has_text="week of").first.wait_for()

    # -- the worst recent answers: the thumbs-down one, and it opens its conversation --------
    worst = page.get_by_role("list", name="Worst recent answers")
    item = worst.locator(f'li[data-id="{weak["message_id"]}"]')
    item.wait_for()
    assert worst.locator("li.fb-item").count() == 1  # the well-grounded, thumbed-up one is not there
    assert "grounded 50%" in item.inner_text() and item.get_by_role("img", name="Thumbs down").count() == 1
    item.get_by_role("link", name=WEAK_Q).click()
    page.wait_for_url(re.compile(rf".*#/chat/{weak['conversation_id']}/{weak['message_id']}$"))
    marked = page.locator(f'.msg.assistant.focused[data-message-id="{weak["message_id"]}"]')
    marked.wait_for()
    assert "bicycle" in marked.inner_text()
    assert page.page_errors == []


def test_the_model_for_chat_card_promotes_canaries_and_rolls_back(
    page: Any, served: Stack, key_store: KeyStore
) -> None:
    """The card on the quality page: the gate's verdict on a fine-tune with its figures, a canary
    started and promoted from there, and a rollback; each click changes what the API says."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from services.agent.protocol import GateScores, GateSet, Promotion

    tenant = f"quality-{uuid.uuid4().hex[:8]}"
    stack, key = served, str(key_store.create(tenant)[0])
    stack.model.own[key] = ["ft-kept"]
    kept = Promotion(
        job_id="ftjob-7",
        candidate="ft-kept",
        status="kept",
        reason="worse than the model it would replace by more than 0.05 on regression: matches 0.40 < 0.90",
        margin=0.05,
        sets=[
            GateSet(
                name="regression",
                questions=10,
                candidate=GateScores(answered=10, matches=0.4, grounded=1.0, cited=1.0),
                current=GateScores(answered=10, matches=0.9, grounded=1.0, cited=1.0),
                worse=["matches 0.40 < 0.90"],
            )
        ],
        created_at=1.0,
    )

    # a verdict of the gate, stored as the gate stores it (Playwright's loop runs in this thread;
    # the store's Redis client gets its own connection, not the server loop's)
    async def save() -> None:
        from services.agent.model_choice import PromotionStore
        from services.common.model_restrictions import ModelRestrictions
        from services.common.redis_conn import async_redis

        client = async_redis(stack.app.state.common.redis_url)
        try:
            turns = stack.app.state.runtime.promotions.turns
            await PromotionStore(turns, ModelRestrictions(client)).save(tenant, kept)
        finally:
            await client.aclose()

    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, save()).result()

    def choice() -> dict[str, Any]:
        out = httpx.get(f"{stack.url}/v1/promotions", headers=auth(key), timeout=30).json()
        return dict(out["choice"])

    page.goto(f"{stack.url}/#/signin?next=quality")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r".*#/quality$"))
    card = page.get_by_role("region", name="Model for chat")
    card.locator("#chat-default", has_text="the base model").wait_for()
    item = card.locator('li[data-job="ftjob-7"]')
    assert "kept as a candidate" in item.inner_text() and "matches 0.40 < 0.90" in item.inner_text()
    cells = item.locator("tr.worse td").all_inner_texts()
    assert cells == ["ft-kept", "40%", "100%", "100%"]

    item.get_by_role("button", name="Canary 10%").click()
    card.locator("#chat-canary", has_text="answers 10% of chats").wait_for()
    assert (choice()["canary"], choice()["canary_share"]) == ("ft-kept", 0.1)
    card.locator("#chat-canary").get_by_role("button", name="Promote").click()
    card.locator("#chat-default code", has_text="ft-kept").wait_for()
    assert choice()["default"] == "ft-kept" and choice()["canary"] is None
    card.get_by_role("button", name="Roll back").click()
    card.locator("#chat-default", has_text="the base model").wait_for()
    assert choice()["default"] is None
    assert page.page_errors == []
