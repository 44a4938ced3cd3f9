"""Evaluation sets and runs (``/v1/evals``) over real HTTP against the retrieval and inference
doubles: sets per tenant (JSON lines uploads naming a bad line, single-question edits, the size
limit, another tenant's 404), runs in the background with progress and judged answers, a judge
model's verdicts, two runs compared with paired standard errors, and the regression check a
gate calls."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from services.agent.config import AgentSettings
from services.agent.evals.judge import Answered
from services.agent.evals.protocol import EvalQuestion, EvalResult, EvalRun, EvalSet
from services.agent.evals.runs import (
    STALE_S,
    Evaluations,
    answered_of,
    compare,
    judged_loss,
    paired_difference,
    paired_se,
    regression_check,
)
from services.agent.evals.store import EvalStore
from services.agent.runtime import AgentRuntime
from services.common.auth import KeyStore
from services.common.config import CommonSettings
from tests.agent.stack import Stack, agent_stack
from tests.conftest import auth

FRANCE = "What is the capital of France?"
GERMANY = "What is the capital of Germany?"
MARS = "How many moons does Mars have?"
QUESTIONS = [
    {"id": "fr", "question": FRANCE, "answers": ["Paris"], "source": "fr", "kind": "what"},
    {"id": "de", "question": GERMANY, "reference": "Berlin is the capital.", "source": "de", "kind": "what"},
    {"id": "mars", "question": MARS, "answerable": False, "kind": "howmany"},
]
JUDGE_SYSTEM = "You grade answers"


def replies(germany: str) -> Any:
    """The scripted model: right about France, ``germany`` about Germany, declining on Mars, and
    as a judge, CORRECT when the graded answer names Paris."""

    def reply(body: dict[str, Any]) -> str:
        msgs = body["messages"]
        if str(msgs[0].get("content", "")).startswith(JUDGE_SYSTEM):
            return "CORRECT: it names the city." if "Paris" in msgs[-1]["content"] else "INCORRECT."
        asked = " ".join(str(m.get("content", "")) for m in msgs if m["role"] == "user")
        if FRANCE in asked:
            return "Paris is the capital of France [1]."
        if GERMANY in asked:
            return germany
        return "I don't know: the sources do not say."

    return reply


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with agent_stack(redis_url, tmp_path_factory.mktemp("home"), eval_max_questions=5) as s:
        yield s


def tenant_key(key_store: KeyStore) -> str:
    return str(key_store.create(f"evals-{uuid.uuid4().hex[:8]}")[0])


@pytest.fixture()
def key(key_store: KeyStore) -> str:
    return tenant_key(key_store)


def call(stack: Stack, key: str, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(
        method, f"{stack.url}{path}", headers={**auth(key), **kw.pop("headers", {})}, timeout=30, **kw
    )


def new_set(
    stack: Stack, key: str, questions: list[dict[str, Any]] | None = None, **more: Any
) -> dict[str, Any]:
    body = {
        "name": "geo basics",
        "collection": "geo",
        "questions": QUESTIONS if questions is None else questions,
    }
    resp = call(stack, key, "POST", "/v1/evals/sets", json={**body, **more})
    assert resp.status_code == 201, resp.text
    return dict(resp.json())


def finished(stack: Stack, key: str, run_id: str) -> dict[str, Any]:
    """The run once it ends (polled: it runs in the agent's background)."""
    deadline = time.monotonic() + 60
    while True:
        run = call(stack, key, "GET", f"/v1/evals/runs/{run_id}").json()
        if run["status"] in ("succeeded", "failed", "cancelled"):
            return dict(run)
        assert time.monotonic() < deadline, run
        time.sleep(0.05)


def start(stack: Stack, key: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = call(stack, key, "POST", "/v1/evals/runs", json=body)
    assert resp.status_code == 202, resp.text
    return dict(resp.json())


# -- sets --------------------------------------------------------------------------------------


def test_sets_crud_jsonl_upload_edits_limit_and_tenants(stack: Stack, key: str, key_store: KeyStore) -> None:
    s = new_set(stack, key, QUESTIONS[:1])
    assert s["id"] and s["regression"] is False and [q["id"] for q in s["questions"]] == ["fr"]
    listed = call(stack, key, "GET", "/v1/evals/sets").json()["data"]
    assert [(x["id"], x["questions"]) for x in listed] == [(s["id"], 1)]

    # JSON lines, as `tandem eval rag --questions` reads them; a question without an id is numbered
    lines = '{"question": "Where is the Eiffel Tower?", "answers": ["Paris"], "source": "eiffel"}\n\n# a comment\n'
    resp = call(
        stack,
        key,
        "POST",
        f"/v1/evals/sets/{s['id']}/questions",
        content=lines.encode(),
        headers={"Content-Type": "application/jsonl"},
    )
    assert resp.status_code == 200, resp.text
    assert [q["id"] for q in resp.json()["questions"]] == ["fr", "q2"]

    bad = '{"question": "ok?", "answerable": false}\n{"question": "no answer or reference", "source": "fr"}\n'
    resp = call(stack, key, "POST", f"/v1/evals/sets/{s['id']}/questions", json={"jsonl": bad})
    assert resp.status_code == 400 and "line 2" in resp.json()["error"]["message"], resp.text
    resp = call(
        stack,
        key,
        "POST",
        f"/v1/evals/sets/{s['id']}/questions",
        content=b'{"question": "x"\n',
        headers={"Content-Type": "application/jsonl"},
    )
    assert resp.status_code == 400 and "line 1: not JSON" in resp.json()["error"]["message"]
    deep = b'{"question": "x", "answerable": false}\n{"question": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    resp = call(
        stack,
        key,
        "POST",
        f"/v1/evals/sets/{s['id']}/questions",
        content=deep,
        headers={"Content-Type": "application/jsonl"},
    )
    assert (
        resp.status_code == 400 and "line 2: nested deeper than 64 levels" in resp.json()["error"]["message"]
    )
    dup = call(stack, key, "POST", f"/v1/evals/sets/{s['id']}/questions", json={"questions": QUESTIONS[:1]})
    assert dup.status_code == 400 and "'fr'" in dup.json()["error"]["message"]

    # one question edited; the result must still be a question
    resp = call(stack, key, "PATCH", f"/v1/evals/sets/{s['id']}/questions/2", json={"answers": ["in Paris"]})
    assert resp.status_code == 200 and resp.json()["answers"] == ["in Paris"], resp.text
    resp = call(stack, key, "PATCH", f"/v1/evals/sets/{s['id']}/questions/2", json={"answerable": False})
    assert resp.status_code == 400
    assert (
        call(stack, key, "PATCH", f"/v1/evals/sets/{s['id']}/questions/9", json={"page": 2}).status_code
        == 404
    )
    assert (
        call(stack, key, "PATCH", f"/v1/evals/sets/{s['id']}/questions/1", json={"page": "2"}).status_code
        == 400
    )

    # the set's limit (5 here) is a 413 naming it, whichever way the questions come
    many = "\n".join(f'{{"question": "q{i}?", "answers": ["a"], "source": "fr"}}' for i in range(4))
    resp = call(stack, key, "POST", f"/v1/evals/sets/{s['id']}/questions", json={"jsonl": many})
    assert resp.status_code == 413 and "at most 5" in resp.json()["error"]["message"], resp.text
    assert len(call(stack, key, "GET", f"/v1/evals/sets/{s['id']}").json()["questions"]) == 2
    six = [{**QUESTIONS[0], "id": f"x{i}"} for i in range(6)]
    assert (
        call(
            stack, key, "POST", "/v1/evals/sets", json={"name": "n", "collection": "geo", "questions": six}
        ).status_code
        == 413
    )
    resp = call(
        stack,
        key,
        "POST",
        f"/v1/evals/sets/{s['id']}/questions?replace=true",
        content=many.encode(),
        headers={"Content-Type": "application/jsonl"},
    )
    assert resp.status_code == 200 and [q["id"] for q in resp.json()["questions"]] == ["q1", "q2", "q3", "q4"]

    resp = call(
        stack, key, "PATCH", f"/v1/evals/sets/{s['id']}", json={"regression": True, "name": "renamed"}
    )
    assert resp.status_code == 200 and resp.json()["regression"] is True and resp.json()["name"] == "renamed"
    assert (
        call(stack, key, "PATCH", f"/v1/evals/sets/{s['id']}", json={"regression": "yes"}).status_code == 400
    )

    # another tenant sees none of it
    other = tenant_key(key_store)
    assert call(stack, other, "GET", "/v1/evals/sets").json()["data"] == []
    for method, path, kw in [
        ("GET", f"/v1/evals/sets/{s['id']}", {}),
        ("PATCH", f"/v1/evals/sets/{s['id']}", {"json": {"name": "mine"}}),
        ("POST", f"/v1/evals/sets/{s['id']}/questions", {"json": {"jsonl": lines}}),
        ("PATCH", f"/v1/evals/sets/{s['id']}/questions/1", {"json": {"page": 3}}),
        ("DELETE", f"/v1/evals/sets/{s['id']}", {}),
        ("POST", "/v1/evals/runs", {"json": {"set": s["id"]}}),
        ("GET", f"/v1/evals/runs?set={s['id']}", {}),
    ]:
        assert call(stack, other, method, path, **kw).status_code == 404, (method, path)

    assert call(stack, key, "DELETE", f"/v1/evals/sets/{s['id']}/questions/1").status_code == 204
    assert len(call(stack, key, "GET", f"/v1/evals/sets/{s['id']}").json()["questions"]) == 3
    assert call(stack, key, "DELETE", f"/v1/evals/sets/{s['id']}").status_code == 204
    assert call(stack, key, "GET", f"/v1/evals/sets/{s['id']}").status_code == 404


def test_only_an_admin_changes_a_regression_set(stack: Stack, key_store: KeyStore) -> None:
    tenant = f"evals-{uuid.uuid4().hex[:8]}"
    admin = key_store.create(tenant, role="admin")[0]
    member = key_store.create(tenant, role="member")[0]
    body = {"name": "gate", "collection": "docs", "questions": QUESTIONS}
    assert call(stack, member, "POST", "/v1/evals/sets", json={**body, "regression": True}).status_code == 403
    gate = call(stack, admin, "POST", "/v1/evals/sets", json={**body, "regression": True}).json()
    mine = call(stack, member, "POST", "/v1/evals/sets", json=body)
    assert mine.status_code == 201, mine.text
    for method, path, kw in [
        ("PATCH", f"/v1/evals/sets/{gate['id']}", {"json": {"regression": False}}),
        ("PATCH", f"/v1/evals/sets/{mine.json()['id']}", {"json": {"regression": True}}),
        ("POST", f"/v1/evals/sets/{gate['id']}/questions", {"json": {"questions": QUESTIONS[1:2]}}),
        ("PATCH", f"/v1/evals/sets/{gate['id']}/questions/1", {"json": {"page": 3}}),
        ("DELETE", f"/v1/evals/sets/{gate['id']}/questions/1", {}),
        ("DELETE", f"/v1/evals/sets/{gate['id']}", {}),
    ]:
        resp = call(stack, member, method, path, **kw)
        assert resp.status_code == 403 and "regression set" in resp.text, (method, path, resp.text)
    # the member still reads the gate, and edits its own set
    assert len(call(stack, member, "GET", f"/v1/evals/sets/{gate['id']}").json()["questions"]) == len(
        QUESTIONS
    )
    renamed = call(stack, member, "PATCH", f"/v1/evals/sets/{mine.json()['id']}", json={"name": "mine"})
    assert renamed.status_code == 200, renamed.text
    assert call(stack, admin, "DELETE", f"/v1/evals/sets/{gate['id']}").status_code == 204


def test_a_chat_answer_becomes_a_question_with_its_correction(stack: Stack, key: str) -> None:
    stack.model.replies = replies("Berlin is the capital of Germany [1].")
    turn = call(
        stack,
        key,
        "POST",
        "/v1/pipelines/chat-documents-generate/run",
        json={"query": GERMANY, "collection": "geo", "remember": False},
    ).json()
    fb = {"message_id": turn["message_id"], "rating": -1, "correction": "Berlin, since 1990."}
    assert call(stack, key, "POST", "/v1/feedback", json=fb).status_code == 200
    s = new_set(stack, key, [])
    resp = call(
        stack,
        key,
        "POST",
        f"/v1/evals/sets/{s['id']}/questions",
        json={"from_message": {"message_id": turn["message_id"]}},
    )
    assert resp.status_code == 200, resp.text
    q = resp.json()["questions"][0]
    assert (q["question"], q["reference"], q["source"]) == (GERMANY, "Berlin, since 1990.", "de")
    resp = call(
        stack,
        key,
        "POST",
        f"/v1/evals/sets/{s['id']}/questions",
        json={"from_message": {"message_id": turn["message_id"], "reference": "Berlin."}},
    )
    assert resp.json()["questions"][1]["reference"] == "Berlin."
    missing = call(
        stack,
        key,
        "POST",
        f"/v1/evals/sets/{s['id']}/questions",
        json={"from_message": {"message_id": "nope"}},
    )
    assert missing.status_code == 404


# -- runs --------------------------------------------------------------------------------------


def test_a_run_answers_judges_and_compares(stack: Stack, key: str, key_store: KeyStore) -> None:
    s = new_set(stack, key)
    stack.model.replies = replies("Berlin is the capital of Germany [1].")
    run = start(stack, key, {"set": s["id"], "judge_model": "scripted"})
    assert run["status"] in ("queued", "running") and run["pipeline"] == "chat-documents-generate"
    assert run["progress"]["total"] == 3
    a = finished(stack, key, run["id"])
    assert a["status"] == "succeeded", a
    assert a["progress"] == {"done": 3, "total": 3}
    by_id = {r["id"]: r for r in a["results"]}
    fr, de, mars = by_id["fr"], by_id["de"], by_id["mars"]
    assert fr["stated"] is True and fr["right_source"] is True and fr["abstained"] is False
    assert fr["citations"][0]["document_id"] == "fr" and fr["latency_seconds"] > 0
    assert de["stated"] is True and de["overlap"] == 1.0 and de["false_abstention"] is False
    assert mars["stated"] is None and mars["abstained"] is True and mars["false_abstention"] is None
    assert fr["judge"]["verdict"] == "correct" and de["judge"]["verdict"] == "incorrect"
    t = a["totals"]
    assert (t["questions"], t["stated"], t["right_source"], t["not_found"], t["false_not_found"]) == (
        3,
        1.0,
        1.0,
        1.0,
        0.0,
    )
    assert t["judged_correct"] == pytest.approx(1 / 3) and t["p50_seconds"] > 0
    assert set(a["totals_by_kind"]) == {"what", "howmany"} and a["totals_by_kind"]["what"]["questions"] == 2

    # the model now misses on Germany: the comparison names the question and keeps both answers
    stack.model.replies = replies("Germany has many forests [1].")
    b = finished(stack, key, start(stack, key, {"set": s["id"], "llm": "scripted"})["id"])
    assert b["status"] == "succeeded" and b["llm"] == "scripted"
    assert (b["totals"]["stated"], b["totals"]["false_not_found"]) == (0.5, 0.0)
    cmp = call(stack, key, "GET", f"/v1/evals/runs/{a['id']}/compare/{b['id']}").json()
    assert cmp["fixed"] == [] and [c["id"] for c in cmp["broken"]] == ["de"] and cmp["same"] == 2
    assert "Berlin" in cmp["broken"][0]["a"]["answer"] and "forests" in cmp["broken"][0]["b"]["answer"]
    stated = cmp["totals"]["stated"]
    assert (stated["a"], stated["b"], stated["difference"]) == (1.0, 0.5, -0.5)
    assert stated["se"] == pytest.approx(0.5)  # d = (0, -1): sqrt(0.5 / 2)
    assert cmp["enough"] is False and cmp["questions_needed"] == 8
    back = call(stack, key, "GET", f"/v1/evals/runs/{b['id']}/compare/{a['id']}").json()
    assert [c["id"] for c in back["fixed"]] == ["de"] and back["broken"] == []

    listed = call(stack, key, "GET", f"/v1/evals/runs?set={s['id']}").json()["data"]
    assert [r["id"] for r in listed] == [b["id"], a["id"]] and "results" not in listed[0]

    other = tenant_key(key_store)
    assert call(stack, other, "GET", f"/v1/evals/runs/{a['id']}").status_code == 404
    assert call(stack, other, "GET", f"/v1/evals/runs/{a['id']}/compare/{b['id']}").status_code == 404


def test_run_requests_name_what_is_wrong(stack: Stack, key: str) -> None:
    s = new_set(stack, key)
    for body, param in [
        ({"set": s["id"], "pipeline": "semantic-search"}, "pipeline"),
        ({"set": s["id"], "pipeline": "nope"}, "pipeline"),
        ({"set": s["id"], "llm": "not-a-model"}, "llm"),
        ({"set": s["id"], "reader": "ft-reader-none"}, "reader"),
        ({"set": "evset-none"}, "set"),
    ]:
        resp = call(stack, key, "POST", "/v1/evals/runs", json=body)
        assert resp.status_code == 404 and resp.json()["error"]["param"] == param, (body, resp.text)
    resp = call(stack, key, "POST", "/v1/evals/runs", json={"set": s["id"], "similarity": "yes"})
    assert resp.status_code == 400
    empty = new_set(stack, key, [])
    assert call(stack, key, "POST", "/v1/evals/runs", json={"set": empty["id"]}).status_code == 400


# -- units: comparison, regression check, interrupted runs -------------------------------------


def result(qid: str, stated: bool, seconds: float = 1.0) -> EvalResult:
    return EvalResult(n=1, id=qid, question=qid, answerable=True, stated=stated, latency_seconds=seconds)


def a_run(run_id: str, results: list[EvalResult]) -> EvalRun:
    return EvalRun(id=run_id, set="s", pipeline="p", created_at=0.0, results=results)


def test_paired_standard_error_and_questions_needed() -> None:
    a = a_run("a", [result(f"q{i}", i < 5) for i in range(10)])
    # b fixes three and breaks one: d has three +1, one -1 and six 0 over ten questions
    b = a_run("b", [result(f"q{i}", (i < 5 and i != 0) or i in (5, 6, 7)) for i in range(10)])
    cmp = compare(a, b)
    d = [-1.0, 0, 0, 0, 0, 1, 1, 1, 0, 0]
    se = math.sqrt(sum((x - 0.2) ** 2 for x in d) / 9 / 10)
    assert paired_se(d) == pytest.approx(se)
    stated = cmp.totals["stated"]
    assert stated.difference == pytest.approx(0.2) and stated.se == pytest.approx(se)
    assert se == pytest.approx(0.2) and not cmp.enough and cmp.questions_needed == 40
    assert [c.id for c in cmp.fixed] == ["q5", "q6", "q7"] and [c.id for c in cmp.broken] == ["q0"]
    assert cmp.same == 6
    # every question fixed the same way: no spread, the difference is plain
    all_fixed = compare(
        a_run("a", [result(f"q{i}", False) for i in range(4)]),
        a_run("b", [result(f"q{i}", True) for i in range(4)]),
    )
    assert all_fixed.enough and all_fixed.totals["stated"].se == 0.0


def test_a_gate_counts_a_loss_beyond_the_margin_only_when_it_is_beyond_2_se() -> None:
    # five questions, one loses its citation: 0.60 -> 0.40, a loss of 0.20 with an SE of 0.20
    flip = paired_difference([(1.0, 0.0), (1.0, 1.0), (1.0, 1.0), (0.0, 0.0), (0.0, 0.0)])
    assert (flip.a, flip.b) == pytest.approx((0.6, 0.4)) and flip.se == pytest.approx(0.2)
    assert judged_loss(flip, 0.05) == "too_few" and flip.questions_needed == 20
    # the same loss on twenty such questions is beyond 2 SE
    many = paired_difference([(1.0, 0.0), (1.0, 1.0), (1.0, 1.0), (0.0, 0.0), (0.0, 0.0)] * 4)
    assert many.se == pytest.approx(math.sqrt(3.2 / 19 / 20))  # four -1 and sixteen 0 about -0.2
    assert judged_loss(many, 0.05) == "worse"
    # within the margin, or a gain, is no loss; a metric's direction can be turned over
    assert judged_loss(flip, 0.25) is None
    gain = paired_difference([(0.0, 1.0)] * 3)
    assert judged_loss(gain, 0.05) is None and judged_loss(gain, 0.05, lower_is_better=True) == "worse"
    # one question has no SE: never enough to tell
    assert judged_loss(paired_difference([(1.0, 0.0), (None, 1.0)]), 0.05) == "too_few"


def test_written_answers_leave_out_the_guards_fallback() -> None:
    from services.agent.chunks import Citation
    from services.agent.pipelines.state import RunState

    replaced = RunState(question="q", collection="c", answer="Paris is the capital. [1]")
    replaced.completion, replaced.answer_kind, replaced.grounding = (
        "I like turtles.",
        "extractive",
        "unsupported",
    )
    replaced.groundedness = 1.0
    replaced.citations = [
        Citation(index=1, chunk_id="fr#0", document_id="fr", title="France", text="", start=0, end=0)
    ]
    shown = answered_of(replaced, 0.1)
    assert shown.answer.startswith("Paris") and shown.citations and shown.groundedness == 1.0
    written = answered_of(replaced, 0.1, written=True)
    assert (written.answer, written.citations, written.groundedness) == ("I like turtles.", [], 0.0)
    # the model's own answer, kept by the guard, is judged as shown
    kept = RunState(question="q", collection="c", answer="Paris. [1]", completion="Paris. [1]")
    kept.grounding, kept.citations = "ok", list(replaced.citations)
    assert answered_of(kept, 0.1, written=True).citations == answered_of(kept, 0.1).citations != []


@pytest.mark.anyio
async def test_regression_check_compares_the_tenant_regression_sets(redis_url: str) -> None:
    client = aioredis.from_url(redis_url, decode_responses=True)
    store = EvalStore(client)
    tenant = f"reg-{uuid.uuid4().hex[:8]}"
    questions = [EvalQuestion.model_validate(q) for q in QUESTIONS]
    for regression, name in ((True, "regression"), (False, "scratch")):
        await store.put_set(
            tenant,
            EvalSet(
                id=f"s-{name}",
                name=name,
                collection="geo",
                regression=regression,
                questions=questions,
                created_at=1.0,
                updated_at=1.0,
            ),
        )
    asked: list[str] = []

    def runner(good: bool) -> Any:
        async def run(q: EvalQuestion, collection: str) -> Answered:
            asked.append(collection)
            if not q.answerable:
                return Answered(answer="The documents do not say.", answer_kind="not_found")
            text = "Paris is the capital. Berlin is the capital." if good else "Madrid."
            return Answered(answer=text, citations=[{"document_id": q.source}], documents=[text])

        return run

    same = await regression_check(tenant, runner(True), runner(True), 0.05, store=store)
    assert same.passed and [s.name for s in same.sets] == ["regression"] and len(asked) == 6
    assert same.sets[0].broken == [] and "broken" not in same.reason
    # both answerable questions lost: every paired difference is -1, so no spread hides it
    worse = await regression_check(tenant, runner(False), runner(True), 0.05, store=store)
    assert not worse.passed and worse.sets[0].worse == ["stated 0.00 < 1.00"]
    stated = worse.sets[0].totals["stated"]
    assert (stated.a, stated.b, stated.se, stated.enough) == (1.0, 0.0, 0.0, True)
    assert [c.id for c in worse.sets[0].broken] == ["fr", "de"]
    assert "regression: stated 0.00 < 1.00" in worse.reason
    assert f"broken: regression: {FRANCE!r}; regression: {GERMANY!r}" in worse.reason
    none = await regression_check(f"{tenant}-x", runner(False), runner(True), 0.05, store=store)
    assert none.passed and none.sets == [] and "no regression set" in none.reason
    await client.aclose()


@pytest.mark.anyio
async def test_a_run_whose_replica_died_reads_as_failed(redis_url: str, tmp_path: Path) -> None:
    client = aioredis.from_url(redis_url, decode_responses=True)
    store = EvalStore(client)
    now = [1000.0]
    common = CommonSettings(home=tmp_path, redis_url=redis_url, log_json=False)
    runtime = AgentRuntime.create(common, AgentSettings(), client)
    evals = Evaluations(runtime.settings, store, runtime.answers, runtime.promotions, clock=lambda: now[0])
    tenant = f"stale-{uuid.uuid4().hex[:8]}"
    run = EvalRun(id="r1", set="s", pipeline="p", status="running", created_at=900.0, heartbeat_at=990.0)
    await store.put_run(tenant, run)
    assert (await evals.run(tenant, "r1")).status == "running"
    now[0] = 990.0 + STALE_S + 1
    got = await evals.run(tenant, "r1")
    assert got.status == "failed" and "interrupted" in (got.error or "")
    assert (await store.get_run(tenant, "r1")).status == "failed"
    runtime.turns.close()
    await client.aclose()
