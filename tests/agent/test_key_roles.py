"""Tenant key roles in the learning loop: a member key sees, rates and corrects only its own
answers and conversations (another key's are a 404 on every route that exposes them), an admin
key sees all of the tenant's; each key counts for a capped number of a training set's rows, every
row names its key, and an admin lists the rows per key and leaves a key's out. Real HTTP, real
Valkey, the real SQLite store; doubles for retrieval, inference and the trainer."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from services.common.auth import ADMIN, MEMBER, KeyStore
from tests.agent.doubles import ScriptedModel
from tests.agent.stack import Stack, agent_stack
from tests.agent.test_feedback import FRANCE, GERMANY, ask, key_id_of, rate, reply
from tests.conftest import auth

CAP = 3


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with agent_stack(
        redis_url,
        tmp_path_factory.mktemp("home"),
        model=ScriptedModel(replies=reply, shared=["scripted"]),
        feedback_rows_per_key=CAP,
        dataset_min_rows_kto=1,
        dataset_min_rows_sft=1,
        promotion_holdout=0.0,
    ) as s:
        yield s


@pytest.fixture()
def keys(key_store: KeyStore) -> dict[str, str]:
    """A fresh tenant's keys: its first (an admin by default) and two members."""
    tenant = f"r{secrets.token_hex(4)}"
    admin, admin_rec = key_store.create(tenant, "first")
    one, one_rec = key_store.create(tenant, "app one")
    two, two_rec = key_store.create(tenant, "app two")
    assert (admin_rec.role, one_rec.role, two_rec.role) == (ADMIN, MEMBER, MEMBER)
    return {"admin": admin, "one": one, "two": two}


def get(stack: Stack, key: str, path: str) -> httpx.Response:
    return httpx.get(f"{stack.url}{path}", headers=auth(key), timeout=30)


def post(stack: Stack, key: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", json=body, headers=auth(key), timeout=30)


def test_a_member_sees_only_its_own_answers_and_an_admin_all(stack: Stack, keys: dict[str, str]) -> None:
    one, two, admin = keys["one"], keys["two"], keys["admin"]
    theirs = ask(stack, one, FRANCE, remember=True)
    mid, conv = theirs["message_id"], theirs["conversation_id"]
    assert rate(stack, one, mid, -1, correction="Paris [1].").status_code == 200
    draft = post(stack, one, f"/v1/messages/{mid}/regenerate").json()
    mine = ask(stack, two, GERMANY)
    assert rate(stack, two, mine["message_id"], -1).status_code == 200

    # Every route that exposes another key's answer, feedback or conversation: a 404, as if missing.
    refused = {
        "GET message": get(stack, two, f"/v1/messages/{mid}"),
        "rate": rate(stack, two, mid, 1),
        "correct": rate(stack, two, mid, -1, correction="Yes."),
        "regenerate": post(stack, two, f"/v1/messages/{mid}/regenerate"),
        "choose": post(stack, two, f"/v1/messages/{draft['message_id']}/choose", {"over": mid}),
        "delete feedback": httpx.delete(f"{stack.url}/v1/feedback/{mid}", headers=auth(two)),
        "GET conversation": get(stack, two, f"/v1/conversations/{conv}"),
        "PATCH conversation": httpx.patch(
            f"{stack.url}/v1/conversations/{conv}", json={"title": "mine now"}, headers=auth(two)
        ),
        "DELETE conversation": httpx.delete(f"{stack.url}/v1/conversations/{conv}", headers=auth(two)),
    }
    for route, resp in refused.items():
        assert resp.status_code == 404, (route, resp.text)
    # choosing one's own draft over another key's answer names the other one as missing
    resp = post(stack, two, f"/v1/messages/{mine['message_id']}/choose", {"over": mid})
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "over", resp.text
    # lists and counts hold only the member's own
    listed = get(stack, two, "/v1/feedback").json()
    assert [f["message_id"] for f in listed["data"]] == [mine["message_id"]] and listed["total"] == 1
    assert get(stack, two, "/v1/feedback/stats").json()["data"][0]["down"] == 1
    assert mid not in {w["message_id"] for w in get(stack, two, "/v1/quality/worst").json()["data"]}
    assert get(stack, two, "/v1/conversations").json()["data"] == []
    assert get(stack, two, f"/v1/conversations?key_id={key_id_of(one)}").status_code == 403
    with connect(stack.ws_url, additional_headers=auth(two), open_timeout=10) as conn:
        conn.send(json.dumps({"type": "feedback", "message_id": mid, "rating": 1}))
        error = json.loads(conn.recv(timeout=10))
        assert error["type"] == "error" and error["code"] == "not_found_error", error
    # nothing the member tried changed the answer's feedback
    assert get(stack, one, "/v1/feedback").json()["data"][0]["correction"] == "Paris [1]."

    # The admin sees and rates every key's answers, and reads their conversations.
    assert get(stack, admin, f"/v1/messages/{mid}").json()["question"] == FRANCE
    listed = get(stack, admin, "/v1/feedback").json()["data"]
    assert {(f["message_id"], f["key_id"]) for f in listed} == {
        (mid, key_id_of(one)),
        (mine["message_id"], key_id_of(two)),
    }
    conversation = get(stack, admin, f"/v1/conversations/{conv}").json()
    assert conversation["id"] == conv and conversation["messages"][-1]["message_id"] == mid
    assert [
        c["id"] for c in get(stack, admin, f"/v1/conversations?key_id={key_id_of(one)}").json()["data"]
    ] == [conv]
    fixed = rate(stack, admin, mid, -1, correction="Paris is the capital [1].")
    assert fixed.status_code == 200 and fixed.json()["key_id"] == key_id_of(admin)


def test_members_cannot_train_promote_or_list_contributors(stack: Stack, keys: dict[str, str]) -> None:
    one = keys["one"]
    for resp in (
        post(stack, one, "/v1/feedback/train", {"format": "kto"}),
        post(stack, one, "/v1/models/scripted/promote"),
        post(stack, one, "/v1/models/scripted/rollback"),
        get(stack, one, "/v1/feedback/contributors"),
    ):
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "forbidden", resp.text
        assert "admin key" in resp.json()["error"]["message"]
    assert get(stack, keys["admin"], "/v1/feedback/contributors").status_code == 200


def test_rows_are_capped_per_key_named_per_row_and_left_out_by_key(
    stack: Stack, keys: dict[str, str]
) -> None:
    one, two, admin = keys["one"], keys["two"], keys["admin"]
    flood = [ask(stack, one, q) for q in (FRANCE, GERMANY) * 3]  # more answers than the cap
    given = [rate(stack, one, a["message_id"], -1, correction="Yes [1].").json() for a in flood]
    # the first CAP count; the rest are stored all the same, and the answer says so
    assert [g["counted"] for g in given] == [True] * CAP + [False] * (len(flood) - CAP)
    assert len(get(stack, one, "/v1/feedback?limit=100").json()["data"]) == len(flood)
    honest = ask(stack, two, FRANCE)
    assert rate(stack, two, honest["message_id"], 1).json()["counted"] is True
    a, b = key_id_of(one), key_id_of(two)

    contributors = get(stack, admin, "/v1/feedback/contributors").json()
    assert contributors["per_key_cap"] == CAP
    by_key = {row["key_id"]: row for row in contributors["data"]}
    assert set(by_key) == {a, b}
    assert (by_key[a]["name"], by_key[a]["ratings"], by_key[a]["corrections"], by_key[a]["counted"]) == (
        "app one",
        len(flood),
        len(flood),
        CAP,
    )
    assert (by_key[b]["name"], by_key[b]["ratings"], by_key[b]["counted"]) == ("app two", 1, 1)
    assert by_key[a]["last_at"] >= given[-1]["updated_at"]

    # The training set: key one's first CAP ratings (each a thumbs down and its correction), key
    # two's thumbs up; every row names its key.
    out = post(stack, admin, "/v1/feedback/datasets", {"format": "kto"}).json()
    rows = stack.trainer.files[out["file_id"]]
    assert out["contributors"] == {a: 2 * CAP, b: 1} and out["over_cap"] == {a: len(flood) - CAP}
    assert out["per_key_cap"] == CAP and out["rows"] == 2 * CAP + 1
    assert sorted(r["key_id"] for r in rows) == sorted([a] * 2 * CAP + [b])
    assert sum(r["completion"] == "Yes [1]." for r in rows) == CAP
    # A member's dataset holds its own answers only.
    own = post(stack, two, "/v1/feedback/datasets", {"format": "sft"}).json()
    assert own["contributors"] == {b: 1} and {r["key_id"] for r in stack.trainer.files[own["file_id"]]} == {b}

    # Left out by key: none of key one's rows, and the dataset says which keys were left out.
    out = post(stack, admin, "/v1/feedback/datasets", {"format": "sft", "exclude_keys": [a]}).json()
    assert out["contributors"] == {b: 1} and out["excluded_keys"] == [a] and out["over_cap"] == {}
    assert [r["key_id"] for r in stack.trainer.files[out["file_id"]]] == [b]
    jobs = len(stack.trainer.jobs)
    trained = post(stack, admin, "/v1/feedback/train", {"format": "sft", "exclude_keys": [a]})
    assert trained.status_code == 200, trained.text
    dataset = trained.json()["dataset"]
    assert dataset["contributors"] == {b: 1} and len(stack.trainer.jobs) == jobs + 1
    assert {r["key_id"] for r in stack.trainer.files[dataset["file_id"]]} == {b}
    # Leaving out every key that gave feedback leaves too little: a 400 naming the left-out keys.
    resp = post(stack, admin, "/v1/feedback/datasets", {"format": "sft", "exclude_keys": [a, b]})
    assert resp.status_code == 400 and "exclude_keys" in resp.json()["error"]["message"], resp.text
