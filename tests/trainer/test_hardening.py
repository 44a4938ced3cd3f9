"""Trainer under hostile or careless clients: deep JSONL, NaN rows, oversize uploads, the
tenant quota, and Idempotency-Key on job and file creation; over real HTTP with a real Valkey."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.common.auth import KeyStore
from services.trainer.config import TrainerSettings
from tests.conftest import auth
from tests.trainer.conftest import jsonl
from tests.trainer.test_api import ROWS, Harness, job_body, serving, upload


@pytest.fixture()
def harness(tandem_env: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    settings = TrainerSettings(max_dataset_mb=1, tenant_quota_mb=2)
    with serving(tiny_model_path, tandem_env, monkeypatch, settings) as h:
        yield h


def test_deeply_nested_and_nan_rows_are_400s_naming_the_line(harness: Harness, api_key: str) -> None:
    good = jsonl(ROWS[:2]).decode()
    deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = upload(harness, api_key, (good + deep + "\n").encode())
    assert r.status_code == 400, r.text[:300]
    assert (
        "line 3" in r.json()["error"]["message"] and "nested deeper than 64" in r.json()["error"]["message"]
    )
    nan_row = '{"prompt": "a", "completion": "b", "label": true, "weight": NaN}'
    r = upload(harness, api_key, (nan_row + "\n").encode())
    assert r.status_code == 400 and "NaN" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "weight"


def test_upload_over_the_limit_and_over_the_quota(harness: Harness, key_store: KeyStore) -> None:
    # fresh tenants: the session's Valkey keeps other tests' files, which count against a quota
    api_key = key_store.create(f"quota-{uuid.uuid4().hex[:8]}")[0]
    other_key = key_store.create(f"quota-{uuid.uuid4().hex[:8]}")[0]
    row = json.dumps(ROWS[5]) + "\n"
    big = (row * (2 * 1024 * 1024 // len(row))).encode()  # ~2 MiB: over the 1 MiB dataset limit
    r = upload(harness, api_key, big)
    assert r.status_code == 413 and "TANDEM_TRAINER_MAX_DATASET_MB" in r.text, r.text[:300]
    almost = (row * (900 * 1024 // len(row))).encode()  # ~0.9 MiB each; the quota is 2 MiB
    assert upload(harness, api_key, almost).status_code == 201
    assert upload(harness, api_key, almost).status_code == 201
    r = upload(harness, api_key, almost)
    assert r.status_code == 507, r.text
    msg = r.json()["error"]["message"]
    assert "2 MiB storage quota" in msg and "TANDEM_TRAINER_TENANT_QUOTA_MB" in msg
    # another tenant has its own quota
    assert upload(harness, other_key, almost).status_code == 201


def test_idempotent_file_and_job_creation(
    harness: Harness, api_key: str, other_key: str, tiny_model_path: Path
) -> None:
    data = jsonl(ROWS)
    key = {"Idempotency-Key": "upload-1"}
    first = httpx.post(
        f"{harness.base}/v1/files", files={"file": ("t.jsonl", data)}, headers={**auth(api_key), **key}
    )
    again = httpx.post(
        f"{harness.base}/v1/files", files={"file": ("t.jsonl", data)}, headers={**auth(api_key), **key}
    )
    assert first.status_code == again.status_code == 201
    assert first.json()["id"] == again.json()["id"] and again.headers["idempotent-replayed"] == "true"
    files = httpx.get(f"{harness.base}/v1/files", headers=auth(api_key)).json()["data"]
    assert [f["id"] for f in files].count(first.json()["id"]) == 1 and files[0]["id"] == first.json()["id"]
    other = httpx.post(
        f"{harness.base}/v1/files",
        files={"file": ("t.jsonl", jsonl(ROWS[:3]))},
        headers={**auth(api_key), **key},
    )
    assert other.status_code == 409 and "Idempotency-Key" in other.json()["error"]["message"]
    # the same key from another tenant is another request
    theirs = httpx.post(
        f"{harness.base}/v1/files", files={"file": ("t.jsonl", data)}, headers={**auth(other_key), **key}
    )
    assert theirs.status_code == 201 and theirs.json()["id"] != first.json()["id"]

    body = job_body(tiny_model_path, first.json()["id"])
    jkey = {**auth(api_key), "Idempotency-Key": "job-1"}
    j1 = httpx.post(f"{harness.base}/v1/jobs", json=body, headers=jkey)
    j2 = httpx.post(f"{harness.base}/v1/jobs", json=body, headers=jkey)
    assert j1.status_code == j2.status_code == 201, j1.text
    assert j1.json()["id"] == j2.json()["id"]
    assert len(harness.dispatched) == 1
    changed = httpx.post(f"{harness.base}/v1/jobs", json={**body, "queue": "gpu"}, headers=jkey)
    assert changed.status_code == 409
    # without the header, two requests are two jobs (the old behaviour)
    httpx.post(f"{harness.base}/v1/jobs", json=body, headers=auth(api_key))
    assert len(harness.dispatched) == 2
