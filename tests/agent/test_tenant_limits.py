"""The agent applies the per-tenant rate limit (429 with Retry-After)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tenant_limits import assert_tenant_rate_limited


def test_agent_tenant_rate_limit(
    tandem_env: Path, api_key: str, other_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_tenant_rate_limited("agent", api_key, other_key, monkeypatch)


def test_websocket_turns_count_against_the_tenant_limit(
    redis_url: str, api_key: str, other_key: str, tmp_path: Path
) -> None:
    """A socket is upgraded once but carries many turns: each turn (and each quick write) takes
    from the tenant's bucket, so one socket cannot send without end."""
    import json

    from websockets.sync.client import connect

    from tests.agent.doubles import cite_first
    from tests.agent.stack import agent_stack
    from tests.agent.test_ws import until_done
    from tests.conftest import auth

    frame = json.dumps({"pipeline": "chat-documents", "collection": "geo", "message": "Capital of France?"})
    with agent_stack(redis_url, tmp_path, tenant_requests_per_minute=1, tenant_burst=1) as stack:
        stack.model.replies = cite_first
        with connect(stack.ws_url, additional_headers=auth(api_key), open_timeout=10) as conn:
            conn.send(frame)
            assert until_done(conn)[-1]["type"] == "done"
            conn.send(frame)
            [refused] = until_done(conn)
            assert refused["type"] == "error" and refused["code"] == "rate_limit_exceeded"
            assert 1 <= refused["retry_after"] <= 60 and "'acme'" in refused["message"]
            conn.send(json.dumps({"type": "feedback", "message_id": "msg_x", "rating": 1}))
            assert json.loads(conn.recv(timeout=30))["code"] == "rate_limit_exceeded"
        with connect(stack.ws_url, additional_headers=auth(other_key), open_timeout=10) as conn:
            conn.send(frame)
            assert until_done(conn)[-1]["type"] == "done"  # another tenant is served
