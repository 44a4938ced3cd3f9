"""Every action the audit log's docstring (services/common/audit.py) lists has a test that makes
it happen and reads it back from the log: a listed action without one fails here."""

from __future__ import annotations

import re
from pathlib import Path

from services.common import audit

ROOT = Path(__file__).resolve().parents[2]

# action -> the test module that performs it and asserts its entry
RECORDED_BY = {
    "key.create": "tests/agent/test_audit.py",
    "key.revoke": "tests/agent/test_audit.py",
    "user.create": "tests/agent/test_audit.py",
    "user.update": "tests/agent/test_audit.py",
    "user.delete": "tests/agent/test_audit.py",
    "token.create": "tests/agent/test_audit.py",
    "token.revoke": "tests/agent/test_audit.py",
    "model.promote": "tests/agent/test_audit.py",
    "model.rollback": "tests/agent/test_audit.py",
    "model.allow": "tests/agent/test_feedback_access.py",
    "model.disallow": "tests/agent/test_feedback_access.py",
    "mcp_server.register": "tests/agent/test_audit.py",
    "mcp_server.update": "tests/agent/test_audit.py",
    "mcp_server.remove": "tests/agent/test_audit.py",
    "training.start": "tests/agent/test_audit.py",
    "training.job": "tests/trainer/test_job_audit.py",
    "document.upload": "tests/agent/test_audit.py",
    "document.delete": "tests/agent/test_audit.py",
    "source.add": "tests/retrieval/test_source_audit.py",
    "source.delete": "tests/retrieval/test_source_audit.py",
    "source.sync": "tests/retrieval/test_source_audit.py",
    "collection.access": "tests/retrieval/test_collection_access.py",
    "user.sign_in": "tests/agent/test_oidc.py",
    "user.sign_out": "tests/agent/test_oidc.py",
}


def listed_actions() -> set[str]:
    doc = audit.__doc__ or ""
    return set(re.findall(r"``([a-z_]+\.[a-z_]+)``", doc.split("The actions recorded:", 1)[1]))


def test_every_listed_action_has_a_test_that_reads_it_back() -> None:
    listed = listed_actions()
    assert "training.job" in listed and "key.create" in listed  # the docstring is parsed
    untested = sorted(listed - set(RECORDED_BY))
    assert not untested, f"audit actions without a test that they are recorded: {untested}"
    for action in sorted(listed):
        module = ROOT / RECORDED_BY[action]
        assert module.exists(), (action, module)
        assert f'"{action}"' in module.read_text(), f"{module} does not check {action!r}"
