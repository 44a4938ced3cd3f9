"""End to end: the agent over the *real* retrieval and inference services (in-process apps over real
HTTP) with the real SmolLM2-135M-Instruct. Marked e2e (slow)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from tests.agent.stack import RealStack, new_key, real_services
from tests.conftest import auth

pytestmark = pytest.mark.e2e

DOCS = [
    {
        "id": "eiffel",
        "title": "The Eiffel Tower",
        "text": "The Eiffel Tower is a wrought-iron lattice tower in Paris, France. It was designed by the "
        "engineering company of Gustave Eiffel and completed in 1889 for the World's Fair. "
        "The tower is 330 metres tall.",
    },
    {
        "id": "photosynthesis",
        "title": "Photosynthesis",
        "text": "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide "
        "to make glucose and oxygen. It takes place in the chloroplasts of leaf cells.",
    },
    {
        "id": "jupiter",
        "title": "Jupiter",
        "text": "Jupiter is the fifth planet from the Sun and the largest planet in the Solar System. "
        "It is a gas giant with a mass more than two and a half times that of all other planets combined. "
        "Its Great Red Spot is a storm larger than Earth.",
    },
    {
        "id": "honey",
        "title": "Honey bees",
        "text": "Honey bees make honey from the nectar of flowers. A colony has one queen, thousands of "
        "worker bees and some drones. Worker bees communicate the location of food with a waggle dance.",
    },
]


@pytest.fixture(scope="module")
def real_stack(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path
) -> Iterator[RealStack]:
    home = tmp_path_factory.mktemp("agent-e2e")
    key = new_key(redis_url, "acme-e2e")
    settings = {
        "tokenizer": str(smollm2_path),
        "max_answer_tokens": 48,
        "agent_max_steps": 4,
        "agent_time_budget_s": 90,
    }
    with real_services(redis_url, home, smollm2_path, key, DOCS, **settings) as stack:
        yield stack


def test_semantic_search_highlights_the_right_passage(real_stack: RealStack) -> None:
    resp = real_stack.run(
        "semantic-search", {"query": "How tall is the Eiffel Tower?", "collection": "facts"}
    )
    top = resp.json()["results"][0]
    assert top["document_id"] == "eiffel" and top["title"] == "The Eiffel Tower"
    assert top["passage"]["text"] == "The tower is 330 metres tall."
    doc = DOCS[0]["text"]
    assert doc[top["passage"]["start"] : top["passage"]["end"]] == "The tower is 330 metres tall."
    assert "<mark>tall</mark>" in top["highlighted"]


def test_chat_streams_an_answer_citing_the_right_document(real_stack: RealStack) -> None:
    with connect(real_stack.ws, additional_headers=auth(real_stack.key), open_timeout=30) as conn:
        conn.send(
            json.dumps(
                {
                    "pipeline": "chat-documents-generate",
                    "collection": "facts",
                    "message": "What is the largest planet in the Solar System?",
                }
            )
        )
        events: list[dict[str, Any]] = []
        while not events or events[-1]["type"] not in ("done", "error"):
            events.append(json.loads(conn.recv(timeout=300)))
    assert events[-1]["type"] == "done", events[-1]
    tokens = [e for e in events if e["type"] == "token"]
    assert len(tokens) > 1  # streamed, not one blob
    answer = "".join(e["text"] for e in tokens)
    citations = events[-1]["citations"]
    print(
        f"\nSmolLM2 answer: {answer!r}\ncitations: {[(c['index'], c['document_id'], c['kind']) for c in citations]}"
    )
    # SmolLM2-135M seldom writes [n] itself (see docs/agent.md); when it does not, the server attributes
    # the answer to the source it overlaps most (kind "attributed"). Either way it must be the right one.
    assert citations, f"no citation for {answer!r}"
    assert citations[0]["document_id"] == "jupiter"
    c = citations[0]
    assert c["title"] == "Jupiter" and DOCS[2]["text"][c["start"] : c["end"]] == c["text"]
    # The turn record: the prompt the real model got (with Jupiter's source) and what it wrote;
    # a regenerated draft samples the same prompt on the same model.
    headers = auth(real_stack.key)
    mid = events[-1]["message_id"]
    rec = httpx.get(f"{real_stack.agent}/v1/messages/{mid}", headers=headers, timeout=30).json()
    assert rec["model"] and answer.startswith(rec["completion"]) and rec["completion"]
    prompt = rec["prompt"][-1]["content"]
    assert "Great Red Spot" in prompt and prompt.endswith("What is the largest planet in the Solar System?")
    resp = httpx.post(f"{real_stack.agent}/v1/messages/{mid}/regenerate", headers=headers, timeout=300)
    assert resp.status_code == 200, resp.text
    draft = resp.json()
    assert (draft["draft_of"], draft["model"]) == (mid, rec["model"]) and draft["answer"]


def test_unrelated_question_gets_i_dont_know(real_stack: RealStack) -> None:
    body = real_stack.run(
        "chat-documents", {"query": "Who won the 1998 football world cup final?", "collection": "facts"}
    ).json()
    assert body["answer"].startswith("I don't know") and body["citations"] == []


CALC_TASKS = [
    ("What is 17 times 23?", "391"),
    ("What is 1234 plus 4321?", "5555"),
    ("What is 144 divided by 12?", "12"),
    ("What is 25 times 25?", "625"),
]


def test_agent_calculator_with_the_real_model(real_stack: RealStack) -> None:
    """SmolLM2-135M drives the agent (the default mode: constrained OpenAI tool calls) and a
    forced final answer after the tool result: it solves at least 3 of the 4 tasks (greedy, so the
    figure is reproducible; benchmarks/agent/tool_tasks.py measures the 20-task set)."""
    solved = 0
    used_tool = 0
    for question, expected in CALC_TASKS:
        resp = real_stack.run("tools-agent", {"query": question})
        body = resp.json()
        steps = body.get("steps", [])
        used_tool += any(s["kind"] == "tool_call" and s["tool"] == "calculator" for s in steps)
        solved += re.match(rf"\s*{expected}\b", body["answer"].replace(",", "")) is not None
        assert body["answer"] or body.get("error")
        calls = [s["input"] for s in steps if s["kind"] == "tool_call"]
        print(f"\n{question} -> {body['answer']!r} calls={calls} error={body.get('error')}")
    print(
        f"\nSmolLM2-135M calculator agent: solved {solved}/{len(CALC_TASKS)}, used the calculator in {used_tool}"
    )
    assert solved >= 3 and used_tool == len(CALC_TASKS)


def test_agent_solves_a_calculator_task_over_the_websocket(real_stack: RealStack) -> None:
    """One task, short: the steps arrive as events and the final answer is the calculator's result."""
    with connect(real_stack.ws, additional_headers=auth(real_stack.key), open_timeout=30) as ws:
        ws.send(json.dumps({"message": "What is 17 times 23?", "pipeline": "tools-agent"}))
        events = []
        while True:
            event = json.loads(ws.recv(timeout=300))
            events.append(event)
            if event["type"] in ("done", "error"):
                break
    steps = [e for e in events if e["type"] == "step"]
    assert [(s["kind"], s.get("tool")) for s in steps if s["kind"] in ("tool_call", "observation")] == [
        ("tool_call", "calculator"),
        ("observation", "calculator"),
    ]
    final = next(s for s in steps if s["kind"] == "final")
    assert final["text"].strip().startswith("391") and events[-1]["type"] == "done"
