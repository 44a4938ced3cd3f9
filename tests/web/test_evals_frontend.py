"""The Evaluations page in a real browser, against the real agent service (which serves the built
front end) over the retrieval and inference doubles: a JSON lines upload (a bad line named, then
a good file), a run followed to its end with each answer's verdicts, two runs side by side with
the broken question first, the set's totals chart, and "Add to evaluation" under a chat answer
and under the Quality page's worst answers."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.common.auth import KeyStore
from tests.agent.stack import Stack, agent_stack
from tests.agent.test_evals import FRANCE, GERMANY, QUESTIONS, replies
from tests.conftest import auth
from tests.web.conftest import DIST


@pytest.fixture()
def served(redis_url: str, tmp_path: Any) -> Iterator[Stack]:
    with agent_stack(redis_url, tmp_path / "home", web_dist=str(DIST)) as stack:
        yield stack


@pytest.fixture()
def page_key(key_store: KeyStore) -> str:
    return str(key_store.create(f"evals-web-{uuid.uuid4().hex[:8]}")[0])


def new_set(stack: Stack, key: str, name: str) -> dict[str, Any]:
    resp = httpx.post(
        f"{stack.url}/v1/evals/sets",
        json={"name": name, "collection": "geo", "questions": []},
        headers=auth(key),
        timeout=30,
    )
    assert resp.status_code == 201, resp.text
    return dict(resp.json())


def sign_in(page: Any, stack: Stack, key: str, next_page: str) -> None:
    page.goto(f"{stack.url}/#/signin?next={next_page}")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(rf".*#/{next_page}$"))


def run_and_wait(page: Any, runs_before: int) -> None:
    page.get_by_role("button", name="Run", exact=True).click()
    page.wait_for_function(
        "n => document.querySelectorAll('.eval-runs li .badge.succeeded').length === n", runs_before + 1
    )


def test_upload_run_compare_and_chart(page: Any, served: Stack, page_key: str, tmp_path: Path) -> None:
    stack, key = served, page_key
    s = new_set(stack, key, "geo basics")
    sign_in(page, stack, key, "evaluations")
    page.get_by_role("list", name="Evaluation sets").get_by_role(
        "link", name=re.compile("geo basics")
    ).click()
    page.wait_for_url(re.compile(rf".*#/evaluations/{s['id']}$"))

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(QUESTIONS[0]) + "\n{not json\n")
    page.get_by_label("Questions file (JSON lines)").set_input_files(str(bad))
    page.get_by_role("button", name="Upload").click()
    state = page.locator(".upload-state")
    state.filter(has_text="line 2").wait_for()
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    page.get_by_label("Questions file (JSON lines)").set_input_files(str(good))
    page.get_by_role("button", name="Upload").click()
    state.filter(has_text="3 questions in the set").wait_for()

    # a run followed to its end: its answers, wrong ones first, with their verdicts
    stack.model.replies = replies("Berlin is the capital of Germany [1].")
    run_and_wait(page, 0)
    answers = page.get_by_role("list", name="Answers")
    answers.locator('li[data-id="fr"]').wait_for()
    fr = answers.locator('li[data-id="fr"]')
    assert "Paris is the capital of France" in fr.inner_text()
    assert fr.locator(".tag.verdict.ok", has_text="stated").count() == 1
    assert fr.locator(".tag.verdict.ok", has_text="right source").count() == 1
    mars = answers.locator('li[data-id="mars"]')
    assert mars.locator(".tag.verdict.ok", has_text="not found: right").count() == 1
    totals = page.locator(".totals-table")
    assert totals.locator('tr[data-metric="stated"] td').inner_text() == "100%"

    # a second run misses Germany: side by side, the broken question with both answers
    stack.model.replies = replies("Germany has many forests [1].")
    run_and_wait(page, 1)
    for box in page.locator("input.pick-run").all():
        box.check()
    page.get_by_role("button", name="Compare the two checked runs").click()
    broken = page.get_by_role("region", name="Broken")
    broken.locator('[data-id="de"]').wait_for()
    pair = broken.locator('[data-id="de"]').inner_text()
    assert "Berlin is the capital of Germany" in pair and "Germany has many forests" in pair
    assert page.get_by_role("region", name="Fixed").locator(".eval-pair").count() == 0
    row = page.locator('.compare-table tr[data-metric="stated"]')
    assert row.locator("td.diff").inner_text() == "-50 pts"
    assert "questions needed" in row.locator("td.enough").inner_text()
    assert "1 broken, 0 fixed, 2 the same" in page.locator(".compare-summary").inner_text()

    # the set's totals over its runs
    chart = page.locator(".eval-chart svg")
    assert "stated: 2 points, latest 0.500" in chart.get_attribute("aria-label")
    assert page.page_errors == []


def test_add_to_evaluation_from_chat_and_quality(page: Any, served: Stack, page_key: str) -> None:
    stack, key = served, page_key
    s = new_set(stack, key, "from chat")
    stack.model.replies = replies(
        "Berlin is the capital of Germany [1]. Germany invented the bicycle in 1492."
    )
    turn = httpx.post(
        f"{stack.url}/v1/pipelines/chat-documents-generate/run",
        json={"query": GERMANY, "collection": "geo", "remember": True},
        headers=auth(key),
        timeout=30,
    ).json()
    sign_in(page, stack, key, "quality")
    page.goto(f"{stack.url}/#/chat/{turn['conversation_id']}/{turn['message_id']}")
    answer = page.locator(f'.msg.assistant[data-message-id="{turn["message_id"]}"]')
    answer.get_by_role("button", name="Add to evaluation").click()
    form = answer.get_by_role("form", name="Add to an evaluation set")
    form.get_by_label("Evaluation set").select_option(s["id"])
    form.get_by_label("Reference answer").fill("Berlin is the capital of Germany.")
    form.get_by_role("button", name="Add", exact=True).click()
    answer.locator(".add-eval-done", has_text="Added to from chat as question 1.").wait_for()
    got = httpx.get(f"{stack.url}/v1/evals/sets/{s['id']}", headers=auth(key), timeout=30).json()
    assert [(q["question"], q["reference"], q["source"]) for q in got["questions"]] == [
        (GERMANY, "Berlin is the capital of Germany.", "de")
    ]

    # the Quality page's worst answers: the reference starts from the answer
    page.get_by_role("link", name="Quality").click()
    item = page.get_by_role("list", name="Worst recent answers").locator(
        f'li[data-id="{turn["message_id"]}"]'
    )
    item.get_by_role("button", name="Add to evaluation").click()
    reference = item.get_by_label("Reference answer")
    assert "bicycle" in reference.input_value()
    reference.fill("Berlin.")
    item.get_by_role("button", name="Add", exact=True).click()
    item.locator(".add-eval-done", has_text="as question 2.").wait_for()
    got = httpx.get(f"{stack.url}/v1/evals/sets/{s['id']}", headers=auth(key), timeout=30).json()
    assert got["questions"][1]["reference"] == "Berlin." and got["questions"][1]["question"] == GERMANY
    assert FRANCE not in [q["question"] for q in got["questions"]]
    assert page.page_errors == []
