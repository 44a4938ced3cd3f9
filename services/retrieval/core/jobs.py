"""Ingestion job state in Redis hashes (never in Celery's result backend).

``tandem:retrieval:job:<id>`` holds tenant, collection, status (queued, running,
succeeded, failed: services/common/jobs.py's names), progress (chunks done / total, documents done / total), the error
if any, attempts, and timestamps. Jobs expire a week after they finish.

``tandem:retrieval:active`` holds the ids of jobs not yet finished, and
``tandem:retrieval:job:<id>:lease`` the lease of the worker running one (services/common/leases.py):
a worker killed mid-job stops renewing it, and a recovery scan requeues the job.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any, NotRequired, TypedDict

import redis

from services.common.jobs import TERMINAL, JobStatus
from services.common.leases import Clock, Leases
from services.retrieval.protocol import Job

JOB_TTL_S = 7 * 24 * 3600
PREFIX = "tandem:retrieval:"
ACTIVE = f"{PREFIX}active"
# The io worker's one task: it runs ingestion and reindex jobs alike (by the job's ``kind``).
TASK_NAME = "tandem.retrieval.ingest"

Dispatch = Callable[[str, str, str], None]  # (tenant, collection, job_id): queue the task


class FileErrorRow(TypedDict):
    """A job's ``file_errors`` entry as stored in its hash (read back as ``protocol.FileError``)."""

    filename: str
    code: str
    message: str
    pages_without_text: NotRequired[list[int]]  # a PDF or image without any text: its pages


def job_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def new_job_id() -> str:
    return f"job_{uuid.uuid4().hex[:20]}"


def decode_job(job_id: str, raw: dict[str, str]) -> Job:
    """The job's Redis hash as the API's model (``tenant`` is checked by the caller)."""

    def num(key: str) -> int:
        return int(raw.get(key, 0) or 0)

    return Job(
        id=job_id,
        collection=raw.get("collection", ""),
        kind=raw.get("kind") or "ingest",  # type: ignore[arg-type]
        # "state": what a worker of an older release wrote (its jobs may still be running).
        status=raw.get("status") or raw.get("state") or "queued",  # type: ignore[arg-type]
        chunks_done=num("chunks_done"),
        chunks_total=num("chunks_total"),
        documents_done=num("documents_done"),
        documents_total=num("documents_total"),
        error=raw.get("error") or None,
        result=json.loads(raw["result"]) if raw.get("result") else None,
        file_errors=json.loads(raw["file_errors"]) if raw.get("file_errors") else [],
        filename=raw.get("filename") or None,
        source_id=raw.get("source_id") or None,
        created_at=float(raw.get("created_at", 0) or 0),
        updated_at=float(raw.get("updated_at", 0) or 0),
    )


class JobStore:
    """Synchronous (worker side and tests)."""

    def __init__(self, client: redis.Redis, clock: Clock | None = None) -> None:
        self.r = client
        self.leases = Leases(client, PREFIX, clock)

    def create(
        self,
        job_id: str,
        tenant: str,
        collection: str,
        *,
        filename: str = "",
        documents: int = 0,
        kind: str = "ingest",
    ) -> None:
        now = time.time()
        self.r.hset(
            job_key(job_id),
            mapping={
                "tenant": tenant,
                "collection": collection,
                "kind": kind,
                "status": "queued",
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
        self.r.sadd(ACTIVE, job_id)

    def update(self, job_id: str, *, status: JobStatus | None = None, **fields: Any) -> None:
        if status is not None:
            fields["status"] = status
        mapping: dict[str, Any] = {
            k: (json.dumps(v) if k in ("result", "file_errors") else v)
            for k, v in fields.items()
            if v is not None
        }
        mapping["updated_at"] = time.time()
        self.r.hset(job_key(job_id), mapping=mapping)  # type: ignore[arg-type]
        if status in TERMINAL:
            self.r.srem(ACTIVE, job_id)

    def get(self, job_id: str) -> Job | None:
        raw = self.r.hgetall(job_key(job_id))
        return decode_job(job_id, raw) if raw else None  # type: ignore[arg-type]

    def raw(self, job_id: str) -> dict[str, str]:
        """The job's hash as stored (tenant, collection, attempts...); empty when there is none."""
        return dict(self.r.hgetall(job_key(job_id)))  # type: ignore[arg-type]

    def active_jobs(self) -> list[str]:
        return sorted(str(x) for x in self.r.smembers(ACTIVE))  # type: ignore[union-attr]

    def forget_active(self, job_id: str) -> None:
        self.r.srem(ACTIVE, job_id)
