"""Answer quality on live traffic: the ``quality`` record of each chat answer (groundedness, cited,
kind, model, rating), its Prometheus metrics, and ``GET /v1/quality`` / ``GET /v1/quality/worst``,
over real HTTP against the retrieval and inference doubles (which serve no embeddings: the guard
judges on word overlap)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.agent.protocol import AnswerQuality, TurnRecord
from services.agent.turns import SqliteTurnStore
from services.common.auth import KeyStore
from tests.agent.stack import Stack, agent_stack
from tests.conftest import auth

GROUNDED = "Berlin is the capital of Germany [1]."
HALF = "Berlin is the capital of Germany [1]. Germany invented the bicycle in 1492."
DEGENERATE = "The answer is:"
UNANSWERABLE = "What is the population of Germany?"


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with agent_stack(redis_url, tmp_path_factory.mktemp("home")) as s:
        yield s


def tenant_key(key_store: KeyStore) -> tuple[str, str]:
    tenant = f"quality-{uuid.uuid4().hex[:8]}"
    return tenant, str(key_store.create(tenant)[0])


def ask(
    stack: Stack, key: str, reply: str, question: str = "What is the capital of Germany?"
) -> dict[str, Any]:
    stack.model.replies = lambda body: reply
    resp = httpx.post(
        f"{stack.url}/v1/pipelines/chat-documents-generate/run",
        json={"query": question, "collection": "geo", "conversation_id": None, "remember": True},
        headers=auth(key),
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def record(stack: Stack, key: str, message_id: str) -> TurnRecord:
    resp = httpx.get(f"{stack.url}/v1/messages/{message_id}", headers=auth(key), timeout=30)
    assert resp.status_code == 200, resp.text
    return TurnRecord.model_validate(resp.json())


def rate(stack: Stack, key: str, message_id: str, rating: int) -> None:
    resp = httpx.post(
        f"{stack.url}/v1/feedback",
        json={"message_id": message_id, "rating": rating},
        headers=auth(key),
        timeout=30,
    )
    assert resp.status_code == 200, resp.text


def merged(points: list[dict[str, Any]]) -> dict[str, Any]:
    """One model's buckets summed back (answers may straddle a bucket boundary)."""
    n = sum(p["answers"] for p in points)
    judged = sum(p["judged"] for p in points)
    rated = sum(p["rated"] for p in points)
    return {
        "answers": n,
        "judged": judged,
        "groundedness_mean": sum((p["groundedness_mean"] or 0) * p["judged"] for p in points) / judged,
        "cited": round(sum(p["cited_share"] * p["answers"] for p in points)),
        "extractive": round(sum(p["extractive_share"] * p["answers"] for p in points)),
        "not_found": round(sum(p["not_found_share"] * p["answers"] for p in points)),
        "rated": rated,
        "up": round(sum((p["thumbs_up_rate"] or 0) * p["rated"] for p in points)),
    }


def test_quality_records_metrics_and_routes(stack: Stack, key_store: KeyStore) -> None:
    tenant, key = tenant_key(key_store)
    _, other = tenant_key(key_store)

    grounded = ask(stack, key, GROUNDED)
    half = ask(stack, key, HALF)
    extractive = ask(stack, key, DEGENERATE)
    missing = ask(stack, key, "Germany has 90 million people [1].", UNANSWERABLE)
    assert (grounded["answer_kind"], half["answer_kind"]) == ("generated", "generated")
    assert (extractive["answer_kind"], missing["answer_kind"]) == ("extractive", "not_found")

    # -- the record: the guard's figures, the citations shown, the kind, the model --------------
    q = record(stack, key, grounded["message_id"]).quality
    assert q == AnswerQuality(
        groundedness=1.0, cited=True, answer_kind="generated", model="scripted", rating=None
    )
    q = record(stack, key, half["message_id"]).quality
    assert q is not None and q.groundedness == 0.5 and q.cited and q.rating is None
    q = record(stack, key, extractive["message_id"]).quality
    assert q is not None and (q.answer_kind, q.groundedness, q.cited) == ("extractive", 1.0, True)
    q = record(stack, key, missing["message_id"]).quality
    # the guard does not judge "not found"; "see also" sources are not citations of the answer
    assert q is not None and (q.answer_kind, q.groundedness, q.cited) == ("not_found", None, False)

    # -- the rating joins the record when feedback arrives, and leaves with it ------------------
    rate(stack, key, grounded["message_id"], 1)
    rate(stack, key, half["message_id"], 1)
    rate(stack, key, half["message_id"], -1)  # turned over
    rate(stack, key, half["message_id"], -1)  # the same again: counted once
    assert record(stack, key, half["message_id"]).quality.rating == -1  # type: ignore[union-attr]
    rate(stack, key, extractive["message_id"], 1)
    resp = httpx.delete(f"{stack.url}/v1/feedback/{extractive['message_id']}", headers=auth(key), timeout=30)
    assert resp.status_code == 200
    assert record(stack, key, extractive["message_id"]).quality.rating is None  # type: ignore[union-attr]

    # -- metrics: read from the app's registry, and as Prometheus text on /metrics --------------
    registry = stack.app.state.metrics.registry
    labels = {"tenant": tenant, "pipeline": "chat-documents-generate", "model": "scripted"}

    def sample(name: str, **extra: str) -> float | None:
        value = registry.get_sample_value(name, {**labels, **extra})
        return None if value is None else float(value)

    assert sample("tandem_agent_answers_total", answer_kind="generated") == 2
    assert sample("tandem_agent_answers_total", answer_kind="extractive") == 1
    assert sample("tandem_agent_answers_total", answer_kind="not_found") == 1
    assert sample("tandem_agent_answers_cited_total") == 3
    assert sample("tandem_agent_answer_groundedness_count") == 3  # not_found is not judged
    assert sample("tandem_agent_answer_groundedness_sum") == pytest.approx(2.5)
    assert sample("tandem_agent_answer_groundedness_bucket", le="0.5") == 1
    assert sample("tandem_agent_answer_ratings_total", rating="up") == 3  # grounded, half, extractive
    assert sample("tandem_agent_answer_ratings_total", rating="down") == 1
    text = httpx.get(f"{stack.url}/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    answers = [s for s in families["tandem_agent_answers"].samples if s.labels.get("tenant") == tenant]
    assert sum(s.value for s in answers if s.name == "tandem_agent_answers_total") == 4

    # -- GET /v1/quality --------------------------------------------------------------------------
    for bucket, seconds in (("hour", 3600), ("day", 86400), ("week", 7 * 86400)):
        resp = httpx.get(
            f"{stack.url}/v1/quality", params={"since": 0, "bucket": bucket}, headers=auth(key), timeout=30
        )
        assert resp.status_code == 200, resp.text
        report = resp.json()
        assert report["bucket"] == bucket and report["since"] == 0
        points = report["data"]
        assert {p["model"] for p in points} == {"scripted"}
        offset = 4 * 86400 if bucket == "week" else 0  # weeks start on Monday
        assert all((p["start"] - offset) % seconds == 0 for p in points)
        assert merged(points) == {
            "answers": 4,
            "judged": 3,
            "groundedness_mean": pytest.approx(2.5 / 3),
            "cited": 3,
            "extractive": 1,
            "not_found": 1,
            "rated": 2,
            "up": 1,
        }
    one = httpx.get(f"{stack.url}/v1/quality", params={"since": 0, "model": "other"}, headers=auth(key))
    assert one.status_code == 200 and one.json()["data"] == []
    default = httpx.get(f"{stack.url}/v1/quality", headers=auth(key)).json()
    assert default["bucket"] == "day" and sum(p["answers"] for p in default["data"]) == 4

    # -- GET /v1/quality/worst: thumbs down first, then the least grounded ----------------------
    worst = httpx.get(f"{stack.url}/v1/quality/worst", params={"since": 0}, headers=auth(key), timeout=30)
    assert worst.status_code == 200, worst.text
    items = worst.json()["data"]
    assert [i["message_id"] for i in items] == [half["message_id"]]
    item = items[0]
    assert item["rating"] == -1 and item["groundedness"] == 0.5 and item["question"]
    assert item["answer"] == half["answer"] and item["conversation_id"] == half["conversation_id"]
    assert item["conversation_id"]  # the page opens the conversation from it
    low = ask(
        stack, key, "Berlin is the capital of Germany [1]. Cats invented the bicycle in 1492. Dogs fly."
    )
    items = httpx.get(f"{stack.url}/v1/quality/worst", params={"limit": 2}, headers=auth(key)).json()["data"]
    assert [i["message_id"] for i in items] == [half["message_id"], low["message_id"]]
    assert (
        httpx.get(f"{stack.url}/v1/quality/worst", params={"limit": 1}, headers=auth(key)).json()["data"][0][
            "message_id"
        ]
        == half["message_id"]
    )

    # -- another tenant sees nothing of the first's ----------------------------------------------
    theirs = httpx.get(f"{stack.url}/v1/quality", params={"since": 0}, headers=auth(other)).json()
    assert theirs["data"] == []
    assert (
        httpx.get(f"{stack.url}/v1/quality/worst", params={"since": 0}, headers=auth(other)).json()["data"]
        == []
    )


@pytest.mark.parametrize(
    ("path", "params", "param"),
    [
        ("/v1/quality", {"bucket": "month"}, "bucket"),
        ("/v1/quality", {"since": "yesterday"}, "since"),
        ("/v1/quality", {"since": "-5"}, "since"),
        ("/v1/quality", {"model": ""}, "model"),
        ("/v1/quality/worst", {"limit": "0"}, "limit"),
        ("/v1/quality/worst", {"limit": "101"}, "limit"),
        ("/v1/quality/worst", {"limit": "many"}, "limit"),
        ("/v1/quality/worst", {"since": "nan-ish"}, "since"),
    ],
)
def test_bad_parameters_are_a_400_naming_them(
    stack: Stack, api_key: str, path: str, params: dict[str, str], param: str
) -> None:
    resp = httpx.get(f"{stack.url}{path}", params=params, headers=auth(api_key), timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and param in error["message"]


def test_the_routes_need_a_key(stack: Stack) -> None:
    assert httpx.get(f"{stack.url}/v1/quality", timeout=30).status_code == 401
    assert httpx.get(f"{stack.url}/v1/quality/worst", timeout=30).status_code == 401


def _turn(message_id: str, created_at: float, groundedness: float | None, model: str = "m") -> TurnRecord:
    return TurnRecord(
        message_id=message_id,
        pipeline="chat-documents-generate",
        model=model,
        created_at=created_at,
        question="q",
        answer="a",
        quality=AnswerQuality(
            groundedness=groundedness, cited=False, answer_kind="generated", model=model, rating=None
        ),
    )


@pytest.mark.anyio
async def test_buckets_are_aligned_and_weeks_start_on_monday(tmp_path: Path) -> None:
    store = SqliteTurnStore(tmp_path / "turns.sqlite3")
    try:
        monday = 1_767_571_200.0  # 2026-01-05 00:00 UTC, a Monday
        await store.add_turn("t", "u", _turn("a", monday - 1, 0.2))  # Sunday night: the week before
        await store.add_turn("t", "u", _turn("b", monday + 10, 0.4))
        await store.add_turn("t", "u", _turn("c", monday + 3 * 86400 + 5, None))
        await store.add_turn("t", "u", _turn("d", monday + 20, 1.0, model="n"))
        await store.add_turn("x", "u", _turn("e", monday + 30, 0.0))  # another tenant
        weeks = await store.quality_series("t", 0, 7 * 86400)
        assert [(p["model"], p["start"], p["answers"], p["judged"]) for p in weeks] == [
            ("m", monday - 7 * 86400, 1, 1),
            ("m", monday, 2, 1),
            ("n", monday, 1, 1),
        ]
        assert weeks[1]["groundedness_mean"] == pytest.approx(0.4) and weeks[1]["thumbs_up_rate"] is None
        days = await store.quality_series("t", monday, 86400, model="m")
        assert [(p["start"], p["answers"]) for p in days] == [(monday, 1), (monday + 3 * 86400, 1)]
        assert days[1]["groundedness_mean"] is None
        await store.set_feedback("t", "d", -1, None, None)
        worst = await store.worst_answers("t", 0, 10)
        assert [(r.message_id, rating) for r, rating in worst] == [("d", -1), ("a", None), ("b", None)]
        assert (await store.get_turn("t", "d")).quality.rating == -1  # type: ignore[union-attr]
        assert await store.worst_answers("t", monday, 10, model="m") == [
            (await store.get_turn("t", "b"), None)
        ]
    finally:
        store.close()
