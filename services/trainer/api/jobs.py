"""``/v1/jobs``: create, watch (JSON, SSE, websocket), cancel, and download artifacts."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import redis.exceptions
from fastapi import APIRouter, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from services.common.app_factory import SSE
from services.common.audit import audit_request
from services.common.auth import Principal, bearer_token, principal_of
from services.common.errors import Forbidden, NotFound
from services.common.idempotency import RESPONSES as IDEMPOTENCY_RESPONSES
from services.common.idempotency import idempotent
from services.trainer import service
from services.trainer.api.deps import JobDep, TenantDep, TrainerDep
from services.trainer.protocol import TERMINAL, ArtifactList, Job, JobCreate, JobList
from services.trainer.store import events_key, job_key

router = APIRouter(
    prefix="/v1",
    tags=["jobs"],
    responses={
        404: {"description": "no such job, dataset file or artifact"},
        409: {"description": "the job has already ended (cancel), or the Idempotency-Key was reused"},
    },
)


CREATE_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "the job spec is invalid (the message names the field and value)"},
    401: {"description": "missing or unknown API key"},
    403: {"description": "'shared' asked without an operator key"},
    404: {"description": "a dataset file or the base model does not exist"},
    **IDEMPOTENCY_RESPONSES,
}


@router.post("/jobs", status_code=201, response_model=Job, responses=CREATE_ERRORS)
async def create_job(spec: JobCreate, request: Request, st: TrainerDep, tenant: TenantDep) -> Any:
    """Validate everything (files, model, LoRA targets, lengths, reward), then queue the job.

    With an ``Idempotency-Key`` header a retry returns the first job instead of queueing a second."""

    # an embedder job from a collection reads its documents with the caller's own key
    key = bearer_token(request) or ""
    if spec.shared and not principal_of(request).operator:
        # a shared reader is served to every tenant: the operator's decision, not one tenant's
        raise Forbidden(
            "shared: only an operator key may publish a reader for every tenant",
            param="shared",
            code="forbidden",
        )

    async def create() -> tuple[int, Any]:
        job = await run_in_threadpool(service.create_job, st, tenant, spec, key)
        await audit_request(
            request, "training.job", job.id, {"type": spec.type, "base_model": spec.base_model}
        )
        return 201, job.to_job().model_dump(mode="json")

    return await idempotent(request, tenant, create)


@router.get("/jobs", response_model=JobList)
def list_jobs(st: TrainerDep, tenant: TenantDep, limit: int = Query(100, ge=1, le=1000)) -> JobList:
    return JobList(data=[job.to_job() for job in st.store.list_jobs(tenant, limit)])


@router.get("/jobs/{job_id}", response_model=Job)
def get_job(job: JobDep) -> Job:
    return job.to_job()


@router.post("/jobs/{job_id}/cancel", response_model=Job)
def cancel_job(job_id: str, st: TrainerDep, tenant: TenantDep) -> Job:
    return st.store.request_cancel(tenant, job_id).to_job()


@router.get("/jobs/{job_id}/metrics")
def job_metrics(job: JobDep, st: TrainerDep) -> dict[str, Any]:
    return {"object": "list", "data": st.store.metrics(job.id)}


@router.get("/jobs/{job_id}/logs")
def job_logs(job: JobDep, st: TrainerDep) -> dict[str, Any]:
    return {"object": "list", "data": st.store.logs(job.id)}


# ---- artifacts
@router.get("/jobs/{job_id}/artifacts", response_model=ArtifactList)
def list_artifacts(job: JobDep, st: TrainerDep) -> ArtifactList:
    return ArtifactList(data=service.artifacts(st, job.id))


@router.get("/jobs/{job_id}/artifacts/{path:path}")
def download_artifact(job: JobDep, path: str, st: TrainerDep) -> FileResponse:
    target = service.artifact_file(st, job.id, path)
    return FileResponse(target, filename=target.name)


# ---- live events (SSE and websocket), both read the job's Redis stream
async def job_events(
    app: Any, job_id: str, last_id: str = "0", block_ms: int = 2_000
) -> AsyncIterator[tuple[str, str, dict[str, Any]]]:
    """(event id, type, data) from the start (or ``last_id``) until the job ends.

    Replays history first, so a client that connects late still sees every step.
    Ends after the terminal status event; an idle stream yields a ``ping``.
    """
    r = app.state.redis
    key = events_key(job_id)
    idle = 0
    while True:
        try:
            got = await r.xread({key: last_id}, count=200, block=block_ms)
        except redis.exceptions.TimeoutError:  # the client's socket timeout hit a long block
            got = None
        if not got:
            status = await r.hget(job_key(job_id), "status")
            if status in TERMINAL:
                return
            idle += block_ms
            if idle >= 15_000:  # keep proxies from closing an idle stream
                idle = 0
                yield "", "ping", {"time": time.time()}
            continue
        idle = 0
        for _stream, entries in got:
            for eid, fields in entries:
                last_id = eid
                data = json.loads(fields["data"])
                yield eid, fields["type"], data
                if fields["type"] == "status" and data.get("status") in TERMINAL:
                    return


@router.get("/jobs/{job_id}/events", response_class=StreamingResponse, responses=SSE)
async def stream_events(job: JobDep, request: Request) -> StreamingResponse:
    """Server-sent events: ``status``, ``progress`` (step, total, metrics) and ``log``."""
    last = request.headers.get("last-event-id") or "0"

    async def body() -> AsyncIterator[bytes]:
        async for eid, type_, data in job_events(request.app, job.id, last):
            head = f"id: {eid}\n" if eid else ""
            yield f"{head}event: {type_}\ndata: {json.dumps(data)}\n\n".encode()
            if await request.is_disconnected():
                return

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.websocket("/ws/jobs/{job_id}")
async def ws_job(websocket: WebSocket, job_id: str) -> None:
    principal = websocket.state.principal
    assert isinstance(principal, Principal)
    protocols = [
        p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",") if p.strip()
    ]
    try:
        # the store's own check (another tenant's job is as missing as one that never existed)
        await run_in_threadpool(websocket.app.state.trainer.store.get_job, principal.tenant, job_id)
    except NotFound as exc:
        await websocket.close(code=4404, reason=exc.message)
        return
    await websocket.accept(subprotocol="tandem.bearer" if "tandem.bearer" in protocols else None)
    try:
        async for eid, type_, data in job_events(websocket.app, job_id):
            await websocket.send_json({"id": eid, "type": type_, **data})
        await websocket.close()
    except (WebSocketDisconnect, asyncio.CancelledError):
        return
