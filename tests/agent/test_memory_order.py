"""A remembered turn keeps the user's message before any answer is generated, so a turn cut
short (the agent killed mid-answer, a failed model call) still leaves it in the conversation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from services.common.auth import KeyStore
from tests.agent.doubles import ScriptedModel
from tests.agent.stack import agent_stack
from tests.conftest import auth


def test_the_users_message_is_stored_before_the_model_is_asked(
    redis_url: str, key_store: KeyStore, tmp_path: Path
) -> None:
    key = key_store.create("memo")[0]
    seen: list[list[dict[str, Any]]] = []
    agent_url: list[str] = []

    def reply(body: dict[str, Any]) -> str:
        # What the conversation holds at the moment the model is asked for the answer.
        convs = httpx.get(f"{agent_url[0]}/v1/conversations", headers=auth(key), timeout=10).json()
        conv = convs["data"][0]["id"]
        got = httpx.get(f"{agent_url[0]}/v1/conversations/{conv}", headers=auth(key), timeout=10).json()
        seen.append(got["messages"])
        return "Paris is the capital of France [1]."

    with agent_stack(redis_url, tmp_path, model=ScriptedModel(replies=reply)) as stack:
        agent_url.append(stack.url)
        question = "What is the capital of France?"
        resp = httpx.post(
            f"{stack.url}/v1/pipelines/chat-documents-generate/run",
            json={"query": question, "collection": "geo", "remember": True},
            headers=auth(key),
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        assert seen and [m["role"] for m in seen[0]] == ["user"] and seen[0][0]["content"] == question
        conv = resp.json()["conversation_id"]
        final = httpx.get(f"{stack.url}/v1/conversations/{conv}", headers=auth(key), timeout=10).json()
        assert [m["role"] for m in final["messages"]] == ["user", "assistant"]  # once each
