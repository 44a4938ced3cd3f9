"""Ingestion jobs: the API side queues them, the ``io`` worker runs them.

The request has already parsed and validated the input (so bad files are a 4xx at
once); the parsed documents go to ``uploads/<job_id>.jsonl`` in the collection's folder
and the task carries only ids. The worker commits documents in batches, so everything
committed is acknowledged even if the job dies later; re-running a job is idempotent
(content-derived chunk ids make re-ingested chunks no-ops).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from celery import Celery

from services.common.errors import TandemError
from services.retrieval.core.atomic import atomic_write
from services.retrieval.core.collection import InputDocument
from services.retrieval.core.jobs import JobStore, new_job_id
from services.retrieval.core.registry import CollectionManager

log = logging.getLogger("tandem.retrieval.jobs")

TASK_NAME = "tandem.retrieval.ingest"
BATCH_DOCS = 32


def enqueue_job(
    celery: Celery,
    jobs: JobStore,
    root: Path,
    tenant: str,
    collection: str,
    docs: list[InputDocument],
    filename: str = "",
) -> str:
    job_id = new_job_id()
    lines = (
        json.dumps({"id": d.id, "text": d.text, "title": d.title, "metadata": d.metadata}, ensure_ascii=False)
        for d in docs
    )
    atomic_write(root / "uploads" / f"{job_id}.jsonl", ("\n".join(lines) + "\n").encode())
    jobs.create(job_id, tenant, collection, filename=filename, documents=len(docs))
    celery.send_task(TASK_NAME, args=[tenant, collection, job_id], queue="io")
    return job_id


def run_job(
    manager: CollectionManager, jobs: JobStore, tenant: str, collection: str, job_id: str
) -> dict[str, Any]:
    """Ingest a queued job's documents, reporting progress in its Redis hash."""
    try:
        col = manager.get(tenant, collection)
        path = col.root / "uploads" / f"{job_id}.jsonl"
        if not path.exists():
            job = jobs.get(job_id)
            if job and job["state"] == "succeeded":
                return job["result"] or {}  # redelivered after it finished
            raise FileNotFoundError(f"job input {path.name} is gone")
        docs = [InputDocument(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
        jobs.update(job_id, state="running", documents_total=len(docs))
        records = col.prepare(docs)
        total = sum(len(r.chunks) for r in records)
        jobs.update(job_id, chunks_total=total)
        done_chunks = done_docs = added = removed = unchanged = 0
        for s in range(0, len(records), BATCH_DOCS):
            batch = records[s : s + BATCH_DOCS]
            batch_chunks = sum(len(r.chunks) for r in batch)
            base = done_chunks

            def progress(done: int, todo: int, base: int = base, n: int = batch_chunks) -> None:
                # Embedding progress within the batch, scaled to its chunk count.
                jobs.update(job_id, chunks_done=base + (n * done // max(todo, 1)))

            res = col.write(batch, progress)
            done_chunks += batch_chunks
            done_docs += len(batch)
            added, removed, unchanged = (
                added + res.chunks_added,
                removed + res.chunks_removed,
                unchanged + res.chunks_unchanged,
            )
            jobs.update(job_id, chunks_done=done_chunks, documents_done=done_docs)
        result = {
            "documents": len(records),
            "chunks_added": added,
            "chunks_removed": removed,
            "chunks_unchanged": unchanged,
        }
        jobs.update(job_id, state="succeeded", result=result)
        os.unlink(path)
        return result
    except TandemError as exc:
        jobs.update(job_id, state="failed", error=exc.message)
        return {"error": exc.message}
    except Exception as exc:
        log.exception("ingestion job %s failed", job_id)
        jobs.update(job_id, state="failed", error=f"{type(exc).__name__}: {exc}")
        raise
