"""``/v1/jobs/{id}``: ingestion job state, and its progress as Server-Sent Events."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from services.common.access import may_read
from services.common.app_factory import SSE
from services.common.auth import acting_principal
from services.common.errors import NotFound
from services.common.jobs import TERMINAL
from services.retrieval.api.deps import access_store
from services.retrieval.core.jobs import decode_job, job_key
from services.retrieval.protocol import Job

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses={404: {"description": "no such job"}})


async def _load(request: Request, job_id: str) -> Job:
    raw = await request.app.state.redis.hgetall(job_key(job_id))
    principal = acting_principal(request)
    # Another tenant's job, or one of a collection the caller may not read, is indistinguishable
    # from a missing one.
    missing = NotFound(f"job {job_id!r} not found", param="id", code="job_not_found")
    if not raw or raw.get("tenant") != principal.tenant:
        raise missing
    if raw.get("collection"):
        acl = await access_store(request).get(principal.tenant, raw["collection"])
        if not may_read(principal, acl):
            raise missing
    return decode_job(job_id, raw)


@router.get("/{job_id}", response_model=Job)
async def get_job(job_id: str, request: Request) -> Job:
    return await _load(request, job_id)


@router.get("/{job_id}/events", response_class=StreamingResponse, responses=SSE)
async def job_events(job_id: str, request: Request) -> StreamingResponse:
    """``event: progress`` whenever the job changes, then one ``event: done`` (or ``failed``)."""
    first = await _load(request, job_id)

    async def stream() -> AsyncIterator[str]:
        job = first
        last: str | None = None
        beat = time.monotonic()
        while True:
            payload = json.dumps(job.model_dump())
            if payload != last:
                last = payload
                beat = time.monotonic()
                if job.status in TERMINAL:
                    yield f"event: {'done' if job.status == 'succeeded' else 'failed'}\ndata: {payload}\n\n"
                    return
                yield f"event: progress\ndata: {payload}\n\n"
            elif time.monotonic() - beat > 15:
                beat = time.monotonic()
                yield ": keep-alive\n\n"
            if await request.is_disconnected():
                return
            await asyncio.sleep(0.25)
            job = await _load(request, job_id)

    return StreamingResponse(
        stream(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
