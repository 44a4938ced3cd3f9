"""POST /v1/feedback with an Idempotency-Key: a retry returns the first answer; the same key
with other feedback is a 409 naming the header."""

from __future__ import annotations

import httpx

from tests.agent.stack import Stack
from tests.agent.test_feedback import FRANCE, ask, foreign_key, key, stack  # noqa: F401  (fixtures)
from tests.conftest import auth


def test_feedback_retry_with_the_same_key_returns_the_first_answer(stack: Stack, key: str) -> None:  # noqa: F811
    answer = ask(stack, key, FRANCE)
    headers = {**auth(key), "Idempotency-Key": "thumbs-1"}
    body = {"message_id": answer["message_id"], "rating": 1, "comment": "good"}
    first = httpx.post(f"{stack.url}/v1/feedback", json=body, headers=headers, timeout=30)
    again = httpx.post(f"{stack.url}/v1/feedback", json=body, headers=headers, timeout=30)
    assert first.status_code == again.status_code == 200, first.text
    assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"
    changed = httpx.post(f"{stack.url}/v1/feedback", json={**body, "rating": -1}, headers=headers, timeout=30)
    assert changed.status_code == 409 and changed.json()["error"]["param"] == "Idempotency-Key"
    listed = httpx.get(f"{stack.url}/v1/feedback", headers=auth(key)).json()
    assert [f["rating"] for f in listed["data"] if f["message_id"] == answer["message_id"]] == [1]
