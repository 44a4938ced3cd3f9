"""Ingestion job state in Redis hashes (never in Celery's result backend).

``tandem:retrieval:job:<id>`` holds tenant, collection, state (queued, running,
succeeded, failed), progress (chunks done / total, documents done / total), the error
if any, and timestamps. Jobs expire a week after they finish.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import redis

JOB_TTL_S = 7 * 24 * 3600
STATES = ("queued", "running", "succeeded", "failed")


def job_key(job_id: str) -> str:
    return f"tandem:retrieval:job:{job_id}"


def new_job_id() -> str:
    return f"job_{uuid.uuid4().hex[:20]}"


def decode_job(job_id: str, raw: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": job_id,
        "tenant": raw.get("tenant", ""),
        "collection": raw.get("collection", ""),
    }
    out["state"] = raw.get("state", "queued")
    for k in ("chunks_done", "chunks_total", "documents_done", "documents_total"):
        out[k] = int(raw.get(k, 0) or 0)
    out["error"] = raw.get("error") or None
    out["result"] = json.loads(raw["result"]) if raw.get("result") else None
    out["file_errors"] = json.loads(raw["file_errors"]) if raw.get("file_errors") else []
    for k in ("created_at", "updated_at"):
        out[k] = float(raw.get(k, 0) or 0)
    out["filename"] = raw.get("filename") or None
    return out


class JobStore:
    """Synchronous (worker side and tests)."""

    def __init__(self, client: redis.Redis) -> None:
        self.r = client

    def create(
        self, job_id: str, tenant: str, collection: str, *, filename: str = "", documents: int = 0
    ) -> None:
        now = time.time()
        self.r.hset(
            job_key(job_id),
            mapping={
                "tenant": tenant,
                "collection": collection,
                "state": "queued",
                "filename": filename,
                "chunks_done": 0,
                "chunks_total": 0,
                "documents_done": 0,
                "documents_total": documents,
                "created_at": now,
                "updated_at": now,
            },
        )
        self.r.expire(job_key(job_id), JOB_TTL_S)

    def update(self, job_id: str, **fields: Any) -> None:
        mapping: dict[str, Any] = {
            k: (json.dumps(v) if k in ("result", "file_errors") else v)
            for k, v in fields.items()
            if v is not None
        }
        mapping["updated_at"] = time.time()
        self.r.hset(job_key(job_id), mapping=mapping)  # type: ignore[arg-type]

    def get(self, job_id: str) -> dict[str, Any] | None:
        raw = self.r.hgetall(job_key(job_id))
        return decode_job(job_id, raw) if raw else None  # type: ignore[arg-type]
