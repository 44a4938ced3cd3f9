"""Issue 13 in the agent: turn records, feedback, drafts and preference pairs, datasets for the trainer,
and the ``llm`` a turn or conversation generates with. Real HTTP, real Valkey, a real SQLite store;
doubles for retrieval, inference and the trainer (tests/agent/doubles.py)."""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from websockets.sync.client import connect

from services.common.auth import KeyStore
from tests.agent.doubles import ScriptedModel, cite_first, inference_double
from tests.agent.stack import Stack, agent_stack
from tests.agent.test_api import sse_events
from tests.agent.test_ws import until_done
from tests.conftest import auth
from tests.helpers.servers import valkey_server
from tests.helpers.waiting import wait_until

MSG_ID = re.compile(r"^msg_[0-9a-f]{24}$")
FRANCE = "What is the capital of France?"
GERMANY = "What is the capital of Germany?"


def reply(body: dict[str, Any]) -> str:
    """Greedy calls answer from the first source; sampled ones (regenerated drafts) say so, so they differ."""
    # the ReAct agent (text protocol or constrained steps)
    if body.get("stop") or body.get("response_format"):
        return "Thought: I know this.\nFinal Answer: forty-two"
    answer = cite_first(body)
    if body.get("temperature", 0) > 0:
        return f"Draft at {body['temperature']}: {answer}"
    return answer


# nothing held out for the promotion gate: these tests count every row (test_promotions.py holds out)
SETTINGS = {
    "dataset_min_rows_kto": 2,
    "dataset_min_rows_dpo": 1,
    "dataset_min_rows_sft": 1,
    "promotion_holdout": 0.0,
}


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model = ScriptedModel(replies=reply, shared=["scripted", "other-base"])
    with agent_stack(
        redis_url,
        tmp_path_factory.mktemp("home"),
        model=model,
        feedback_max_correction_chars=200,
        # the records of a ReAct agent's raw reply are checked below ("...Final Answer: ...")
        tool_calling="react",
        **SETTINGS,
    ) as s:
        yield s


@pytest.fixture()
def key(key_store: KeyStore) -> str:
    """A key of a fresh tenant: feedback is per tenant, so each test starts with none."""
    return key_store.create(f"t{secrets.token_hex(4)}")[0]


@pytest.fixture()
def foreign_key(key_store: KeyStore) -> str:
    return key_store.create(f"f{secrets.token_hex(4)}")[0]


def ask(stack: Stack, key: str, query: str = FRANCE, **extra: Any) -> dict[str, Any]:
    resp = httpx.post(
        f"{stack.url}/v1/pipelines/{extra.pop('pipeline', 'chat-documents-generate')}/run",
        json={"query": query, "collection": "geo", **extra},
        headers=auth(key),
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def rate(stack: Stack, key: str, message_id: str, rating: int, **extra: Any) -> httpx.Response:
    return httpx.post(
        f"{stack.url}/v1/feedback",
        json={"message_id": message_id, "rating": rating, **extra},
        headers=auth(key),
        timeout=30,
    )


def key_id_of(key: str) -> str:
    """The id in a key ``tdm_<id>_<secret>``."""
    return key.split("_")[1]


def record(stack: Stack, key: str, message_id: str) -> dict[str, Any]:
    resp = httpx.get(f"{stack.url}/v1/messages/{message_id}", headers=auth(key), timeout=30)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


# -- 1. message_id everywhere, and the record --------------------------------------------------


def test_every_interface_returns_a_message_id_that_names_its_record(stack: Stack, key: str) -> None:
    body = ask(stack, key, remember=True)
    assert MSG_ID.match(body["message_id"]) and body["model"] == "scripted"
    ids = [body["message_id"]]
    with httpx.stream(
        "POST",
        f"{stack.url}/v1/pipelines/chat-documents-generate/run",
        json={
            "query": GERMANY,
            "collection": "geo",
            "stream": True,
            "conversation_id": body["conversation_id"],
        },
        headers=auth(key),
        timeout=30,
    ) as resp:
        done = sse_events(resp)[-1]
    assert done["type"] == "done" and MSG_ID.match(done["message_id"])
    ids.append(done["message_id"])
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key)
    out = client.chat.completions.create(
        model="chat-documents-generate",
        messages=[{"role": "user", "content": FRANCE}],
        extra_body={"collection": "geo"},
    )
    assert out.model_extra and MSG_ID.match(out.model_extra["message_id"])
    ids.append(out.model_extra["message_id"])
    chunks = list(
        client.chat.completions.create(
            model="chat-documents-generate",
            messages=[{"role": "user", "content": GERMANY}],
            extra_body={"collection": "geo"},
            stream=True,
        )
    )
    assert chunks[-1].model_extra and MSG_ID.match(chunks[-1].model_extra["message_id"])
    ids.append(chunks[-1].model_extra["message_id"])
    with connect(stack.ws_url, additional_headers=auth(key), open_timeout=10) as conn:
        conn.send(json.dumps({"pipeline": "chat-documents-generate", "collection": "geo", "message": FRANCE}))
        ws_done = until_done(conn)[-1]
    assert MSG_ID.match(ws_done["message_id"])
    ids.append(ws_done["message_id"])
    agent = ask(stack, key, "What is six times seven?", pipeline="tools-agent")
    assert agent["answer"] == "forty-two" and MSG_ID.match(agent["message_id"])
    ids.append(agent["message_id"])
    assert len(set(ids)) == len(ids)
    for message_id in ids:
        assert record(stack, key, message_id)["message_id"] == message_id
    # The stored conversation messages carry them too.
    conv = httpx.get(f"{stack.url}/v1/conversations/{body['conversation_id']}", headers=auth(key)).json()
    assert [m.get("message_id") for m in conv["messages"] if m["role"] == "assistant"] == ids[:2]


def test_the_record_holds_the_exact_prompt_the_model_saw(stack: Stack, key: str) -> None:
    body = ask(stack, key, GERMANY, remember=True)
    sent = stack.model.requests[-1]
    rec = record(stack, key, body["message_id"])
    assert rec["prompt"] == sent["messages"]  # after retrieval and prompt assembly, exactly
    assert "Berlin is the capital of Germany" in rec["prompt"][-1]["content"]
    assert rec["model"] == sent["model"] == "scripted"
    assert rec["sampling"] == {"max_tokens": sent["max_tokens"], "temperature": sent["temperature"]}
    assert rec["completion"] == body["answer"] and rec["citations"] == body["citations"]
    assert rec["chunk_ids"][0] == "de#0" and set(rec["chunk_ids"]) <= {"de#0", "fr#0", "eiffel#0"}
    assert (rec["pipeline"], rec["collection"], rec["conversation_id"]) == (
        "chat-documents-generate",
        "geo",
        body["conversation_id"],
    )
    assert rec["draft_of"] is None and abs(rec["created_at"] - time.time()) < 60
    assert "tenant" not in rec and "sources" not in rec
    # The agent's record is its last model call, and its raw reply.
    agent = ask(stack, key, "What is six times seven?", pipeline="tools-agent")
    rec = record(stack, key, agent["message_id"])
    assert rec["prompt"] == stack.model.requests[-1]["messages"] and rec["kind"] == "agent"
    assert rec["completion"].endswith("Final Answer: forty-two") and rec["answer"] == "forty-two"
    # No model call ("I don't know"): a record with no prompt and no model.
    nothing = ask(stack, key, "How do volcanoes erupt under the ocean?")
    rec = record(stack, key, nothing["message_id"])
    assert rec["prompt"] == [] and rec["model"] == ""


def test_records_survive_restarts_of_the_agent_and_of_valkey(tmp_path: Path) -> None:
    home = tmp_path / "home"
    model = ScriptedModel(replies=reply)
    with valkey_server(tmp_path / "valkey-1") as url:
        client = redis.Redis.from_url(url, decode_responses=True)
        key = KeyStore(client).create("acme")[0]
        with agent_stack(url, home, model=model) as s:
            body = ask(s, key, FRANCE, remember=True)
            assert rate(s, key, body["message_id"], 1).status_code == 200
            before = record(s, key, body["message_id"])
        client.close()
    # A new Valkey with nothing in it (its data folder is new) and a new agent on the same home.
    with valkey_server(tmp_path / "valkey-2") as url:
        client = redis.Redis.from_url(url, decode_responses=True)
        assert client.dbsize() == 0
        key = KeyStore(client).create("acme")[0]
        with agent_stack(url, home, model=model) as s:
            assert record(s, key, body["message_id"]) == before
            listed = httpx.get(f"{s.url}/v1/feedback", headers=auth(key)).json()
            assert [f["message_id"] for f in listed["data"]] == [body["message_id"]]
        client.close()


def test_memory_expiry_keeps_records_and_only_delete_removes_them(
    stack: Stack, key: str, redis_client: redis.Redis
) -> None:
    kept = ask(stack, key, FRANCE, remember=True)
    conv = kept["conversation_id"]
    assert rate(stack, key, kept["message_id"], -1, correction="Paris [1].").status_code == 200
    # Expire the conversation's memory the way Redis does (TTL reached), then wait until it is gone.
    keys = redis_client.keys(f"tandem:agent:conv:*:{conv}*")
    assert keys
    for k in keys:
        redis_client.pexpire(k, 1)
    # reading an expired key removes it
    wait_until(lambda: not any(redis_client.exists(k) for k in keys), 10, "the keys expire", interval=0.01)
    assert httpx.get(f"{stack.url}/v1/conversations/{conv}", headers=auth(key)).status_code == 404
    assert record(stack, key, kept["message_id"])["conversation_id"] == conv
    # Deleting the (expired) conversation deletes its records and their feedback.
    assert httpx.delete(f"{stack.url}/v1/conversations/{conv}", headers=auth(key)).status_code == 204
    assert httpx.get(f"{stack.url}/v1/messages/{kept['message_id']}", headers=auth(key)).status_code == 404
    assert httpx.get(f"{stack.url}/v1/feedback", headers=auth(key)).json()["total"] == 0
    # A live conversation: DELETE removes memory and records; a turn outside it is untouched.
    live = ask(stack, key, GERMANY, remember=True)
    other = ask(stack, key, GERMANY)
    assert (
        httpx.delete(f"{stack.url}/v1/conversations/{live['conversation_id']}", headers=auth(key)).status_code
        == 204
    )
    assert httpx.get(f"{stack.url}/v1/messages/{live['message_id']}", headers=auth(key)).status_code == 404
    assert record(stack, key, other["message_id"])["conversation_id"] is None
    assert httpx.delete(f"{stack.url}/v1/conversations/conv_{'0' * 24}", headers=auth(key)).status_code == 404


# -- 2. feedback -----------------------------------------------------------------------------------


def test_feedback_crud_filters_paging_and_stats(stack: Stack, key: str) -> None:
    first = ask(stack, key, FRANCE)
    second = ask(stack, key, GERMANY, llm="other-base")
    third = ask(stack, key, GERMANY)
    resp = rate(stack, key, first["message_id"], 1, comment="good")
    assert resp.status_code == 200, resp.text
    fb = resp.json()
    assert fb["rating"] == 1 and fb["comment"] == "good" and fb["correction"] is None
    assert (fb["pipeline"], fb["model"], fb["collection"]) == ("chat-documents-generate", "scripted", "geo")
    assert (fb["question"], fb["answer"]) == (FRANCE, first["answer"])
    created = fb["created_at"]
    cut = time.time()
    rate(stack, key, second["message_id"], -1, correction="Berlin [1].")
    rate(stack, key, third["message_id"], 1)

    def listed(**params: Any) -> dict[str, Any]:
        resp = httpx.get(f"{stack.url}/v1/feedback", params=params, headers=auth(key))
        assert resp.status_code == 200, resp.text
        body: dict[str, Any] = resp.json()
        return body

    assert {f["message_id"] for f in listed(since=cut)["data"]} == {second["message_id"], third["message_id"]}
    # Replacing: same message, new rating; created_at kept, updated_at moves.
    again = rate(stack, key, first["message_id"], -1).json()
    assert again["rating"] == -1 and again["created_at"] == created and again["updated_at"] > created
    everything = listed()
    assert everything["object"] == "list" and everything["total"] == 3 and not everything["has_more"]
    assert [f["message_id"] for f in everything["data"]] == [
        first["message_id"],  # most recently changed first
        third["message_id"],
        second["message_id"],
    ]
    assert {f["message_id"] for f in listed(rating=-1)["data"]} == {first["message_id"], second["message_id"]}
    assert [f["message_id"] for f in listed(model="other-base")["data"]] == [second["message_id"]]
    assert listed(pipeline="semantic-search")["total"] == 0
    assert listed(pipeline="chat-documents-generate")["total"] == 3
    page1, page2 = listed(limit=2), listed(limit=2, offset=2)
    assert (page1["total"], page1["has_more"], len(page1["data"])) == (3, True, 2)
    assert (page2["has_more"], len(page2["data"])) == (False, 1)
    assert page1["data"][0]["message_id"] != page2["data"][0]["message_id"]
    stats = httpx.get(f"{stack.url}/v1/feedback/stats", headers=auth(key)).json()["data"]
    assert stats == [
        {"model": "other-base", "up": 0, "down": 1, "corrections": 1, "preferences": 0},
        {"model": "scripted", "up": 1, "down": 1, "corrections": 0, "preferences": 0},
    ]
    resp = httpx.delete(f"{stack.url}/v1/feedback/{third['message_id']}", headers=auth(key))
    assert resp.json() == {"message_id": third["message_id"], "deleted": True}
    assert listed()["total"] == 2
    again = httpx.delete(f"{stack.url}/v1/feedback/{third['message_id']}", headers=auth(key))
    assert again.status_code == 404 and again.json()["error"]["param"] == "message_id"
    assert record(stack, key, third["message_id"])["message_id"] == third["message_id"]  # the record stays


def test_another_tenants_message_is_a_404_everywhere(stack: Stack, key: str, foreign_key: str) -> None:
    mine = ask(stack, key, FRANCE)
    rate(stack, key, mine["message_id"], 1)
    for resp in (
        rate(stack, foreign_key, mine["message_id"], -1),
        httpx.get(f"{stack.url}/v1/messages/{mine['message_id']}", headers=auth(foreign_key)),
        httpx.delete(f"{stack.url}/v1/feedback/{mine['message_id']}", headers=auth(foreign_key)),
        httpx.post(
            f"{stack.url}/v1/messages/{mine['message_id']}/regenerate", json={}, headers=auth(foreign_key)
        ),
    ):
        assert resp.status_code == 404, resp.text
        assert resp.json()["error"]["param"] == "message_id"
    assert httpx.get(f"{stack.url}/v1/feedback", headers=auth(foreign_key)).json()["total"] == 0
    assert httpx.get(f"{stack.url}/v1/feedback/stats", headers=auth(foreign_key)).json()["data"] == []
    assert httpx.get(f"{stack.url}/v1/feedback", headers=auth(key)).json()["data"][0]["rating"] == 1


@pytest.mark.parametrize(
    ("body", "status", "param", "needle"),
    [
        ({"rating": 2}, 400, "rating", "rating"),
        ({"rating": 0}, 400, "rating", "rating"),
        ({"rating": 1, "correction": "x" * 201}, 413, "correction", "the limit is 200"),
        ({"rating": -1, "correction": "  "}, 400, "correction", "empty"),
        ({"rating": 1, "message_id": "msg_" + "0" * 24}, 404, "message_id", "no message"),
        ({"rating": 1, "stars": 5}, 400, "stars", "stars"),
    ],
)
def test_bad_feedback_is_a_4xx_naming_the_field(
    stack: Stack, key: str, body: dict[str, Any], status: int, param: str, needle: str
) -> None:
    mine = ask(stack, key, FRANCE)
    resp = httpx.post(
        f"{stack.url}/v1/feedback", json={"message_id": mine["message_id"], **body}, headers=auth(key)
    )
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param and needle in resp.json()["error"]["message"]
    bad = httpx.get(f"{stack.url}/v1/feedback", params={"rating": 3}, headers=auth(key))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rating"


def test_regenerate_samples_a_new_draft_and_choose_records_a_pair(stack: Stack, key: str) -> None:
    original = ask(stack, key, FRANCE, remember=True)
    rec = record(stack, key, original["message_id"])
    resp = httpx.post(
        f"{stack.url}/v1/messages/{original['message_id']}/regenerate", headers=auth(key), timeout=30
    )
    assert resp.status_code == 200, resp.text
    draft = resp.json()
    sent = stack.model.requests[-1]
    assert sent["messages"] == rec["prompt"] and sent["model"] == rec["model"]  # the exact recorded prompt
    assert sent["temperature"] == 0.8  # sampled, not greedy (regenerate_temperature)
    assert MSG_ID.match(draft["message_id"]) and draft["message_id"] != original["message_id"]
    assert draft["draft_of"] == original["message_id"] and draft["model"] == "scripted"
    assert draft["answer"] != original["answer"] and draft["answer"].startswith("Draft at 0.8")
    assert draft["citations"][0]["document_id"] == "fr" and draft["finish_reason"] == "stop"
    drec = record(stack, key, draft["message_id"])
    assert drec["prompt"] == rec["prompt"] and drec["draft_of"] == original["message_id"]
    assert drec["sampling"]["temperature"] == 0.8 and drec["conversation_id"] == original["conversation_id"]
    # Streaming: the events of a turn, 'done' naming the draft and what it is a draft of.
    with httpx.stream(
        "POST",
        f"{stack.url}/v1/messages/{draft['message_id']}/regenerate",
        json={"stream": True},
        headers=auth(key),
        timeout=30,
    ) as resp:
        events = sse_events(resp)
    assert "token" in [e["type"] for e in events] and events[-1]["type"] == "done"
    third = events[-1]
    assert third["draft_of"] == original["message_id"] and MSG_ID.match(third["message_id"])
    # Choose one draft over another of the same prompt.
    resp = httpx.post(
        f"{stack.url}/v1/messages/{draft['message_id']}/choose",
        json={"over": original["message_id"]},
        headers=auth(key),
    )
    assert resp.json() == {"chosen": draft["message_id"], "rejected": original["message_id"]}
    unrelated = ask(stack, key, GERMANY)
    for over, status, needle in (
        (unrelated["message_id"], 400, "not a draft of the same prompt"),
        (draft["message_id"], 400, "chosen message itself"),
        ("msg_" + "1" * 24, 404, "no message"),
    ):
        resp = httpx.post(
            f"{stack.url}/v1/messages/{draft['message_id']}/choose", json={"over": over}, headers=auth(key)
        )
        assert resp.status_code == status and resp.json()["error"]["param"] == "over", resp.text
        assert needle in resp.json()["error"]["message"]
    stats = httpx.get(f"{stack.url}/v1/feedback/stats", headers=auth(key)).json()["data"]
    assert stats == [{"model": "scripted", "up": 0, "down": 0, "corrections": 0, "preferences": 1}]
    # An answer no model wrote cannot be regenerated.
    nothing = ask(stack, key, "How do volcanoes erupt under the ocean?")
    resp = httpx.post(f"{stack.url}/v1/messages/{nothing['message_id']}/regenerate", headers=auth(key))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "message_id"


# -- 3. datasets -------------------------------------------------------------------------------------


def build(stack: Stack, key: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{stack.url}/v1/feedback/datasets", json=body, headers=auth(key), timeout=30)


def test_datasets_of_each_format_have_the_exact_rows(stack: Stack, key: str) -> None:
    up = ask(stack, key, FRANCE)
    down = ask(stack, key, GERMANY)
    agent = ask(stack, key, "What is six times seven?", pipeline="tools-agent")
    rate(stack, key, up["message_id"], 1)
    rate(stack, key, down["message_id"], -1, correction="Berlin [1].")
    rate(stack, key, agent["message_id"], -1, correction="42")
    draft = httpx.post(
        f"{stack.url}/v1/messages/{up['message_id']}/regenerate", headers=auth(key), timeout=30
    ).json()
    httpx.post(
        f"{stack.url}/v1/messages/{up['message_id']}/choose",
        json={"over": draft["message_id"]},
        headers=auth(key),
    )
    p_up, p_down, p_agent = (record(stack, key, m["message_id"]) for m in (up, down, agent))
    agent_fixed = p_agent["completion"].replace("Final Answer: forty-two", "Final Answer: 42")
    by = key_id_of(key)  # every row names the key that gave its feedback

    resp = build(stack, key, format="kto")
    assert resp.status_code == 200, resp.text
    out = resp.json()
    kto = [
        {"prompt": p_up["prompt"], "completion": up["answer"], "label": True, "key_id": by},
        {"prompt": p_down["prompt"], "completion": down["answer"], "label": False, "key_id": by},
        {"prompt": p_down["prompt"], "completion": "Berlin [1].", "label": True, "key_id": by},
        {"prompt": p_agent["prompt"], "completion": p_agent["completion"], "label": False, "key_id": by},
        {"prompt": p_agent["prompt"], "completion": agent_fixed, "label": True, "key_id": by},
    ]
    assert stack.trainer.files[out["file_id"]] == kto
    assert out == {
        "file_id": out["file_id"],
        "format": "kto",
        "rows": 5,
        "counts": {"desirable": 3, "undesirable": 2, "corrections": 2},
        "contributors": {by: 5},
        "per_key_cap": 200,
        "over_cap": {},
        "excluded_keys": [],
        "left_out": [],
        "collections": ["geo"],  # the pipeline's and the agent's answers both searched geo
    }
    assert stack.trainer.file_headers[-1]["authorization"] == f"Bearer {key}"  # the caller's own key

    out = build(stack, key, format="dpo").json()
    assert stack.trainer.files[out["file_id"]] == [
        {"prompt": p_down["prompt"], "chosen": "Berlin [1].", "rejected": down["answer"], "key_id": by},
        {"prompt": p_agent["prompt"], "chosen": agent_fixed, "rejected": p_agent["completion"], "key_id": by},
        {"prompt": p_up["prompt"], "chosen": up["answer"], "rejected": draft["answer"], "key_id": by},
    ]
    assert (out["format"], out["rows"], out["counts"]) == ("dpo", 3, {"corrections": 2, "preferences": 1})

    out = build(stack, key, format="sft").json()
    assert stack.trainer.files[out["file_id"]] == [
        {"messages": [*p_up["prompt"], {"role": "assistant", "content": up["answer"]}], "key_id": by},
        {"messages": [*p_down["prompt"], {"role": "assistant", "content": "Berlin [1]."}], "key_id": by},
        {"messages": [*p_agent["prompt"], {"role": "assistant", "content": agent_fixed}], "key_id": by},
    ]
    assert out["counts"] == {"thumbs_up": 1, "corrections": 2}
    # Filters: only the pipeline's answers.
    out = build(stack, key, format="sft", pipeline="tools-agent").json()
    assert out["rows"] == 1 and out["counts"] == {"thumbs_up": 0, "corrections": 1}


def test_too_little_feedback_is_a_400_naming_counts_found_and_needed(stack: Stack, key: str) -> None:
    resp = build(stack, key, format="sft")
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "not_enough_feedback"
    assert "0 rows found, at least 1 needed" in resp.json()["error"]["message"]
    ups = [ask(stack, key, q) for q in (FRANCE, GERMANY)]
    for m in ups:
        rate(stack, key, m["message_id"], 1)
    resp = build(stack, key, format="kto")
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert "no undesirable rows found, at least 1 needed" in message
    assert "desirable=2, undesirable=0" in message
    resp = build(stack, key, format="dpo")
    assert resp.status_code == 400 and "0 rows found, at least 1 needed" in resp.json()["error"]["message"]
    resp = build(stack, key, format="sft", since=time.time() + 3600)
    assert resp.status_code == 400 and "since=" in resp.json()["error"]["message"]
    resp = build(stack, key, format="orpo")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "format"
    assert build(stack, key, format="sft").json()["rows"] == 2


def test_train_on_feedback_starts_a_published_lora_job_on_the_answering_model(stack: Stack, key: str) -> None:
    a = ask(stack, key, FRANCE)
    b = ask(stack, key, GERMANY)
    rate(stack, key, a["message_id"], 1)
    rate(stack, key, b["message_id"], -1)
    resp = httpx.post(
        f"{stack.url}/v1/feedback/train", json={"eval_fraction": 0.25}, headers=auth(key), timeout=30
    )
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["dataset"]["format"] == "kto" and out["dataset"]["rows"] == 2
    assert stack.trainer.jobs[-1] == {
        "type": "kto",
        "base_model": "scripted",
        "dataset": out["dataset"]["file_id"],
        "lora": {},
        "publish": True,
        "eval_fraction": 0.25,
    }
    assert (
        out["job"]["id"].startswith("ftjob-")
        and stack.trainer.job_headers[-1]["authorization"] == f"Bearer {key}"
    )
    # Answers of two models: name one.
    c = ask(stack, key, FRANCE, llm="other-base")
    d = ask(stack, key, GERMANY, llm="other-base")
    rate(stack, key, c["message_id"], 1, correction="Paris [1].")
    rate(stack, key, d["message_id"], -1)
    jobs = len(stack.trainer.jobs)
    resp = httpx.post(f"{stack.url}/v1/feedback/train", json={"format": "sft"}, headers=auth(key), timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"
    assert "other-base, scripted" in resp.json()["error"]["message"] and len(stack.trainer.jobs) == jobs
    resp = httpx.post(
        f"{stack.url}/v1/feedback/train",
        json={"format": "sft", "model": "other-base"},
        headers=auth(key),
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    assert stack.trainer.jobs[-1]["type"] == "sft" and stack.trainer.jobs[-1]["base_model"] == "other-base"
    assert "eval_fraction" not in stack.trainer.jobs[-1]
    assert (
        stack.trainer.files[resp.json()["dataset"]["file_id"]][0]["messages"][-1]["content"] == "Paris [1]."
    )


def test_train_on_feedback_picks_dpo_where_corrections_outnumber_thumbs_up(stack: Stack, key: str) -> None:
    answers = [ask(stack, key, q) for q in (FRANCE, GERMANY, FRANCE)]
    rate(stack, key, answers[0]["message_id"], 1)
    rate(stack, key, answers[1]["message_id"], -1, correction="Berlin [1].")
    rate(stack, key, answers[2]["message_id"], -1, correction="Paris is the capital [1].")

    def train() -> dict[str, Any]:
        resp = httpx.post(f"{stack.url}/v1/feedback/train", json={}, headers=auth(key), timeout=30)
        assert resp.status_code == 200, resp.text
        out: dict[str, Any] = resp.json()
        assert stack.trainer.jobs[-1]["type"] == out["dataset"]["format"]
        return out

    out = train()  # 2 corrections, 1 thumbs up: each correction chosen over the answer it corrects
    assert out["dataset"]["format"] == "dpo" and out["dataset"]["counts"]["corrections"] == 2
    rate(stack, key, ask(stack, key, GERMANY)["message_id"], 1)
    assert train()["dataset"]["format"] == "kto"  # as many thumbs up as corrections


# -- 4. llm ------------------------------------------------------------------------------------------


def test_llm_is_validated_for_the_caller_and_remembered_by_the_conversation(
    stack: Stack, key: str, foreign_key: str
) -> None:
    stack.model.own[key] = ["ft-mine"]
    try:
        for llm in ("nope", "ft-theirs", "all-MiniLM-L6-v2"):  # unknown, foreign, cannot chat
            stack.model.own[foreign_key] = ["ft-theirs"]
            resp = httpx.post(
                f"{stack.url}/v1/pipelines/chat-documents-generate/run",
                json={"query": FRANCE, "collection": "geo", "llm": llm, "remember": True},
                headers=auth(key),
            )
            assert resp.status_code == 404, resp.text
            assert resp.json()["error"]["param"] == "llm" and repr(llm) in resp.json()["error"]["message"]
        assert httpx.get(f"{stack.url}/v1/conversations", headers=auth(key)).json()["data"] == []
        first = ask(stack, key, FRANCE, llm="ft-mine", remember=True)
        assert stack.model.requests[-1]["model"] == "ft-mine" and first["model"] == "ft-mine"
        conv = first["conversation_id"]
        meta = httpx.get(f"{stack.url}/v1/conversations/{conv}", headers=auth(key)).json()
        assert meta["llm"] == "ft-mine"
        second = ask(stack, key, GERMANY, conversation_id=conv)  # no llm: the conversation's
        assert stack.model.requests[-1]["model"] == "ft-mine"
        assert record(stack, key, second["message_id"])["model"] == "ft-mine"
        third = ask(stack, key, GERMANY, conversation_id=conv, llm="scripted")  # overridden, and remembered
        assert stack.model.requests[-1]["model"] == "scripted" and third["model"] == "scripted"
        ask(stack, key, FRANCE, conversation_id=conv)
        assert stack.model.requests[-1]["model"] == "scripted"
        # The facade (llm beside collection; model names the pipeline) and the agents take it too.
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key)
        out = client.chat.completions.create(
            model="chat-documents-generate",
            messages=[{"role": "user", "content": FRANCE}],
            extra_body={"collection": "geo", "llm": "ft-mine"},
        )
        assert stack.model.requests[-1]["model"] == "ft-mine" and out.model == "chat-documents-generate"
        with pytest.raises(openai.NotFoundError, match="ft-theirs"):
            client.chat.completions.create(
                model="chat-documents-generate",
                messages=[{"role": "user", "content": FRANCE}],
                extra_body={"collection": "geo", "llm": "ft-theirs"},
            )
        agent = ask(stack, key, "What is six times seven?", pipeline="tools-agent", llm="ft-mine")
        assert (
            stack.model.requests[-1]["model"] == "ft-mine"
            and record(stack, key, agent["message_id"])["model"] == "ft-mine"
        )
        with connect(stack.ws_url, additional_headers=auth(key), open_timeout=10) as conn:
            conn.send(
                json.dumps(
                    {
                        "pipeline": "chat-documents-generate",
                        "collection": "geo",
                        "message": FRANCE,
                        "llm": "nope",
                    }
                )
            )
            [error] = until_done(conn)
            assert (
                error["type"] == "error"
                and error["code"] == "model_not_found"
                and "'nope'" in error["message"]
            )
            conn.send(
                json.dumps(
                    {
                        "pipeline": "chat-documents-generate",
                        "collection": "geo",
                        "message": FRANCE,
                        "llm": "ft-mine",
                    }
                )
            )
            done = until_done(conn)[-1]
        assert done["model"] == "ft-mine" and stack.model.requests[-1]["model"] == "ft-mine"
    finally:
        stack.model.own.clear()


# -- websocket frames ----------------------------------------------------------------------------------


def test_websocket_feedback_regenerate_and_choose_frames(stack: Stack, key: str, foreign_key: str) -> None:
    with connect(stack.ws_url, additional_headers=auth(key), open_timeout=10) as conn:
        conn.send(json.dumps({"pipeline": "chat-documents-generate", "collection": "geo", "message": FRANCE}))
        done = until_done(conn)[-1]
        mid = done["message_id"]
        conn.send(
            json.dumps({"type": "feedback", "message_id": mid, "rating": -1, "correction": "Paris [1]."})
        )
        assert json.loads(conn.recv(timeout=10)) == {"type": "feedback", "message_id": mid, "ok": True}
        conn.send(json.dumps({"type": "feedback", "message_id": mid, "rating": 3}))
        error = json.loads(conn.recv(timeout=10))
        assert error["type"] == "error" and error["code"] == "invalid_frame" and "rating" in error["message"]
        conn.send(json.dumps({"type": "regenerate", "message_id": mid}))
        events = until_done(conn)
        assert "token" in [e["type"] for e in events]
        draft = events[-1]
        assert draft["type"] == "done" and draft["draft_of"] == mid and MSG_ID.match(draft["message_id"])
        conn.send(json.dumps({"type": "choose", "message_id": draft["message_id"], "over": mid}))
        assert json.loads(conn.recv(timeout=10)) == {
            "type": "choice",
            "chosen": draft["message_id"],
            "rejected": mid,
        }
        conn.send(json.dumps({"type": "regenerate", "message_id": "msg_" + "2" * 24}))
        error = json.loads(conn.recv(timeout=10))
        assert error["type"] == "error" and error["code"] == "not_found_error"
    listed = httpx.get(f"{stack.url}/v1/feedback", headers=auth(key)).json()["data"]
    assert [(f["message_id"], f["rating"], f["correction"]) for f in listed] == [(mid, -1, "Paris [1].")]
    with connect(stack.ws_url, additional_headers=auth(foreign_key), open_timeout=10) as conn:
        conn.send(json.dumps({"type": "feedback", "message_id": mid, "rating": 1}))
        error = json.loads(conn.recv(timeout=10))
        assert (
            error["type"] == "error" and error["param"] == "message_id" and error["code"] == "not_found_error"
        )


def test_datasets_and_a_job_through_the_real_trainer(
    redis_url: str,
    tandem_env: Path,
    tiny_model_path: Path,
    key: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real trainer app over HTTP: it parses the uploaded rows (messages and preference formats)
    and validates the job (base model, dataset kind) before queueing it."""
    from services.common.config import CommonSettings
    from services.trainer.app import create_app as trainer_app
    from services.trainer.config import TrainerSettings
    from tests.helpers.servers import serve_app

    monkeypatch.setenv("TANDEM_MODEL_ROOTS", str(tiny_model_path.parent))
    # The trainer asks the inference service (here its double) what it can serve with its service key.
    monkeypatch.setenv("TANDEM_SERVICE_API_KEY", key)
    base = str(tiny_model_path)  # the model the inference double serves by default, by its path
    model = ScriptedModel(replies=reply, shared=[base])
    queued: list[str] = []

    def trainer(inference_url: str) -> Any:
        app = trainer_app(CommonSettings(inference_url=inference_url), TrainerSettings())
        # No Celery hop: a job message left on the shared Valkey could be taken by another test's worker.
        app.state.trainer.dispatch = lambda job_id, queue: queued.append(job_id)
        return app

    with (
        # The trainer may ask the inference service what it can serve before it accepts a job.
        serve_app(inference_double(model)) as i_url,
        serve_app(trainer(i_url)) as t_url,
        agent_stack(redis_url, tandem_env / "agent-home", model=model, trainer_url=t_url, **SETTINGS) as s,
    ):
        up, down = ask(s, key, FRANCE), ask(s, key, GERMANY)
        assert record(s, key, up["message_id"])["model"] == base
        rate(s, key, up["message_id"], 1)
        rate(s, key, down["message_id"], -1, correction="Berlin is the capital of Germany [1].")
        for fmt, trainer_format, rows in (("sft", "messages", 2), ("dpo", "preference", 1)):
            resp = build(s, key, format=fmt)
            assert resp.status_code == 200, resp.text
            stored = httpx.get(f"{t_url}/v1/files/{resp.json()['file_id']}", headers=auth(key)).json()
            assert (stored["format"], stored["rows"]) == (trainer_format, rows)
        resp = httpx.post(f"{s.url}/v1/feedback/train", json={"format": "dpo"}, headers=auth(key), timeout=60)
        assert resp.status_code == 200, resp.text
        job = resp.json()["job"]
        assert (job["type"], job["base_model"], job["status"]) == ("dpo", base, "queued")
        assert job["request"]["publish"] is True and job["dataset"] == resp.json()["dataset"]["file_id"]
        assert queued == [job["id"]]


def test_a_reopened_conversation_shows_the_feedback_on_its_answers(stack: Stack, key: str) -> None:
    first = ask(stack, key, FRANCE, remember=True)
    conv = first["conversation_id"]
    second = ask(stack, key, GERMANY, conversation_id=conv)
    rate(stack, key, second["message_id"], -1, correction="Berlin [1].")
    body = httpx.get(f"{stack.url}/v1/conversations/{conv}", headers=auth(key), timeout=30).json()
    answers = {m["message_id"]: m for m in body["messages"] if m["role"] == "assistant"}
    assert set(answers) == {first["message_id"], second["message_id"]}
    assert "feedback" not in answers[first["message_id"]]
    assert answers[second["message_id"]]["feedback"] == {
        "rating": -1,
        "correction": "Berlin [1].",
        "comment": None,
    }
