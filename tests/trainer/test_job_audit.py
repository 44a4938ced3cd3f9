"""A training job in the audit log: ``POST /v1/jobs`` appends ``training.job`` naming the job,
its type, its base model and who started it; a refused job appends nothing. Real HTTP, real
Valkey, the trainer API (the Celery hop recorded, as in test_api.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from services.common.audit import AuditEntry, AuditFilter, AuditLog
from services.common.redis_conn import async_redis
from tests.conftest import auth
from tests.trainer.conftest import jsonl
from tests.trainer.test_api import ROWS, Harness, job_body, upload
from tests.trainer.test_api import harness as harness  # the module's fixture


def training_jobs(redis_url: str, tenant: str) -> list[AuditEntry]:
    async def read() -> list[AuditEntry]:
        r = async_redis(redis_url)
        try:
            return (await AuditLog(r).entries(tenant, AuditFilter(action="training.job")))[0]
        finally:
            await r.aclose()

    return asyncio.run(read())


def test_starting_a_job_is_recorded(
    harness: Harness, api_key: str, tiny_model_path: Path, redis_url: str
) -> None:
    before = {e.target for e in training_jobs(redis_url, "acme")}
    fid = upload(harness, api_key, jsonl(ROWS)).json()["id"]
    refused = httpx.post(
        f"{harness.base}/v1/jobs", json=job_body(tiny_model_path, "file-missing"), headers=auth(api_key)
    )
    assert refused.status_code == 404
    made = httpx.post(f"{harness.base}/v1/jobs", json=job_body(tiny_model_path, fid), headers=auth(api_key))
    assert made.status_code == 201, made.text
    [entry] = [e for e in training_jobs(redis_url, "acme") if e.target not in before]
    assert entry.target == made.json()["id"]
    assert (entry.actor.kind, entry.actor.id) == ("key", api_key.split("_")[1])
    assert entry.detail == {"type": "sft", "base_model": str(tiny_model_path)}
