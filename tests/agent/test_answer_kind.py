"""``answer_kind`` ("generated" | "extractive" | "not_found") on the done event, the turn record
and the OpenAI facade's response, over real HTTP (retrieval and inference doubles: the doubles
serve no embeddings, so the answer step scores on words alone); and a corrected "not found"
still makes a training row."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from services.agent.feedback import build_dataset
from services.agent.protocol import TurnRecord
from services.agent.turns import FeedbackRow
from tests.agent.stack import Stack, agent_stack
from tests.conftest import auth

UNANSWERABLE = "What is the population of Germany?"


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with agent_stack(redis_url, tmp_path_factory.mktemp("home")) as s:
        yield s


def test_not_found_in_the_done_event_the_record_and_without_a_model_call(stack: Stack, api_key: str) -> None:
    stack.model.replies = lambda body: "Germany has 90 million people [1]."
    calls = len(stack.model.requests)
    request = {"query": UNANSWERABLE, "collection": "geo", "stream": True}
    with httpx.stream(
        "POST",
        f"{stack.url}/v1/pipelines/chat-documents/run",
        json=request,
        headers=auth(api_key),
        timeout=30,
    ) as resp:
        events = [json.loads(line[5:]) for line in resp.iter_lines() if line.startswith("data:")]
    done = events[-1]
    assert done["type"] == "done" and done["answer_kind"] == "not_found"
    shown = "".join(e["text"] for e in events if e["type"] == "token")
    assert shown.startswith("Your documents do not say what is the population of Germany.")
    assert {c["kind"] for c in done["citations"]} == {"see_also"}
    assert len(stack.model.requests) == calls  # the model was not asked
    record = httpx.get(
        f"{stack.url}/v1/messages/{done['message_id']}", headers=auth(api_key), timeout=30
    ).json()
    assert (record["answer_kind"], record["answer"], record["completion"]) == ("not_found", shown, "")
    assert record["prompt"] and record["model"] == "scripted"  # what a correction trains on

    # A thumbs-down with a correction is a training row of the recorded prompt.
    rec = TurnRecord.model_validate(record)
    fb = FeedbackRow(done["message_id"], -1, "About 84 million people live in Germany.", None, 1.0, 1.0)
    kto = build_dataset("kto", [(fb, rec)], [])
    assert [(r["completion"], r["label"]) for r in kto.rows] == [
        (shown, False),
        ("About 84 million people live in Germany.", True),
    ]
    dpo = build_dataset("dpo", [(fb, rec)], [])
    assert [(r["chosen"], r["rejected"]) for r in dpo.rows] == [
        ("About 84 million people live in Germany.", shown)
    ]
    assert dpo.rows[0]["prompt"] == [{"role": m["role"], "content": m["content"]} for m in record["prompt"]]


def test_the_facade_says_answer_kind_beside_citations(stack: Stack, api_key: str) -> None:
    stack.model.replies = lambda body: "Berlin is the capital of Germany [1]."
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=api_key)
    answered = client.chat.completions.create(
        model="chat-documents-generate",
        messages=[{"role": "user", "content": "What is the capital of Germany?"}],
        extra_body={"collection": "geo"},
    )
    extra = answered.model_extra or {}
    assert extra["answer_kind"] == "generated" and extra["citations"]
    missing = client.chat.completions.create(
        model="chat-documents-generate",
        messages=[{"role": "user", "content": UNANSWERABLE}],
        extra_body={"collection": "geo"},
    )
    assert (missing.model_extra or {})["answer_kind"] == "not_found"
    assert (missing.choices[0].message.content or "").startswith("Your documents do not say")
    stream = client.chat.completions.create(
        model="chat-documents-generate",
        messages=[{"role": "user", "content": UNANSWERABLE}],
        extra_body={"collection": "geo"},
        stream=True,
    )
    last = list(stream)[-1]
    assert (last.model_extra or {})["answer_kind"] == "not_found"
