"""``/v1/jobs``: create, watch (JSON, SSE, websocket), cancel, and download artifacts."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import redis.exceptions
from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from services.common.app_factory import SSE
from services.common.auth import Principal, principal_of
from services.common.errors import InvalidRequest, NotFound
from services.common.idempotency import RESPONSES as IDEMPOTENCY_RESPONSES
from services.common.idempotency import idempotent
from services.trainer.api.deps import TrainerState, state_of
from services.trainer.jobspec import KIND_OF, JobOwner, check_own_artifact, validate_job
from services.trainer.protocol import TERMINAL, Artifact, ArtifactList, Job, JobCreate, JobList, Progress
from services.trainer.publish import check_publishable
from services.trainer.runner import artifact_dir, dataset_path, job_dir
from services.trainer.store import events_key, job_key, new_id

router = APIRouter(
    prefix="/v1",
    tags=["jobs"],
    responses={
        404: {"description": "no such job, dataset file or artifact"},
        409: {"description": "the job has already ended (cancel), or the Idempotency-Key was reused"},
    },
)


def job_object(job_id: str, data: dict[str, str]) -> Job:
    spec = json.loads(data["spec"])

    def opt_float(key: str) -> float | None:
        v = data.get(key)
        return float(v) if v else None

    return Job(
        id=job_id,
        type=data["type"],  # type: ignore[arg-type]
        status=data["status"],  # type: ignore[arg-type]
        base_model=spec["base_model"],
        dataset=spec["dataset"],
        eval_dataset=spec.get("eval_dataset"),
        queue=data.get("queue", "cpu"),
        progress=Progress(step=int(data.get("step") or 0), total=int(data.get("total") or 0)),
        metrics=json.loads(data.get("metrics") or "{}"),
        error=data.get("error") or None,
        created_at=float(data["created_at"]),
        started_at=opt_float("started_at"),
        finished_at=opt_float("finished_at"),
        attempts=int(data.get("attempts") or 0),
        fine_tuned_model=data.get("fine_tuned_model") or None,
        published=data.get("published") == "1",
        request=spec,
    )


def _check_files(st: TrainerState, tenant: str, spec: JobCreate) -> tuple[Path, Path | None]:
    kind = KIND_OF[spec.type]
    paths: list[Path | None] = []
    for param, fid in (("dataset", spec.dataset), ("eval_dataset", spec.eval_dataset)):
        if fid is None:
            paths.append(None)
            continue
        meta = st.store.get_file(tenant, fid, param=param)
        kinds = json.loads(meta["kinds"])
        if kind not in kinds:
            raise InvalidRequest(
                f"{param}: file {fid!r} is in {meta['format']} format, which suits {', '.join(kinds)} jobs, not {spec.type}",
                param=param,
            )
        paths.append(dataset_path(st.common, tenant, fid))
    assert paths[0] is not None
    return paths[0], paths[1]


def _create(st: TrainerState, tenant: str, spec: JobCreate) -> Job:
    dataset, eval_ds = _check_files(st, tenant, spec)
    owner = JobOwner(tenant, st.store)
    if spec.reward is not None and spec.reward.model is not None:
        check_own_artifact(spec.reward.model, st.common, owner, "reward.model")
    resolved = validate_job(spec, dataset, eval_ds, st.common, st.settings, owner)
    # a job from an adapter keeps that adapter's rank; otherwise the rank asked for
    lineage = resolved.lineage
    if lineage and lineage.init_adapter and spec.lora is not None and lineage.parent_rank is not None:
        # the job trains the parent adapter further: record the rank it really has
        spec = spec.model_copy(update={"lora": spec.lora.model_copy(update={"r": lineage.parent_rank})})
    check_publishable(st.common, spec, spec.lora.r if spec.lora else None)
    job_id = new_id("ftjob")
    queue = spec.queue or st.settings.default_queue
    st.store.create_job(
        tenant,
        job_id,
        {
            "type": spec.type,
            "spec": spec.model_dump_json(),
            "queue": queue,
            "model_path": str(resolved.model_path),
        },
    )
    st.store.log(
        job_id, f"queued on {queue!r}: {len(resolved.records)} rows, base model {resolved.model_path}"
    )
    st.dispatch(job_id, queue)
    return job_object(job_id, st.store.job(job_id))


@router.post(
    "/jobs",
    status_code=201,
    response_model=Job,
    responses={
        400: {"description": "the job spec is invalid (the message names the field and value)"},
        401: {"description": "missing or unknown API key"},
        404: {"description": "a dataset file does not exist"},
        **IDEMPOTENCY_RESPONSES,
    },
)
async def create_job(spec: JobCreate, request: Request) -> Any:
    """Validate everything (files, model, LoRA targets, lengths, reward), then queue the job.

    With an ``Idempotency-Key`` header a retry returns the first job instead of queueing a second."""
    st, tenant = state_of(request), principal_of(request).tenant

    async def create() -> tuple[int, Any]:
        job = await run_in_threadpool(_create, st, tenant, spec)
        return 201, job.model_dump(mode="json")

    return await idempotent(request, tenant, create)


@router.get("/jobs", response_model=JobList)
def list_jobs(request: Request, limit: int = 100) -> JobList:
    if not 1 <= limit <= 1000:
        raise InvalidRequest(f"limit must be between 1 and 1000, got {limit}", param="limit")
    st = state_of(request)
    return JobList(
        data=[job_object(jid, d) for jid, d in st.store.list_jobs(principal_of(request).tenant, limit)]
    )


@router.get("/jobs/{job_id}", response_model=Job)
def get_job(job_id: str, request: Request) -> Job:
    st = state_of(request)
    return job_object(job_id, st.store.get_job(principal_of(request).tenant, job_id))


@router.post("/jobs/{job_id}/cancel", response_model=Job)
def cancel_job(job_id: str, request: Request) -> Job:
    st = state_of(request)
    return job_object(job_id, st.store.request_cancel(principal_of(request).tenant, job_id))


@router.get("/jobs/{job_id}/metrics")
def job_metrics(job_id: str, request: Request) -> dict[str, Any]:
    st = state_of(request)
    st.store.get_job(principal_of(request).tenant, job_id)
    return {"object": "list", "data": st.store.metrics(job_id)}


@router.get("/jobs/{job_id}/logs")
def job_logs(job_id: str, request: Request) -> dict[str, Any]:
    st = state_of(request)
    st.store.get_job(principal_of(request).tenant, job_id)
    return {"object": "list", "data": st.store.logs(job_id)}


# ---- artifacts
def _artifact_roots(st: TrainerState, job_id: str) -> dict[str, Path]:
    return {
        "checkpoints": job_dir(st.common, job_id) / "checkpoints",
        "final": artifact_dir(st.common, job_id),
    }


@router.get("/jobs/{job_id}/artifacts", response_model=ArtifactList)
def list_artifacts(job_id: str, request: Request) -> ArtifactList:
    st = state_of(request)
    st.store.get_job(principal_of(request).tenant, job_id)
    out = []
    for top, root in _artifact_roots(st, job_id).items():
        if not root.is_dir():
            continue
        for f in sorted(root.rglob("*")):
            if f.is_file() and not any(part.startswith(".tmp") for part in f.relative_to(root).parts):
                rel = f"{top}/{f.relative_to(root).as_posix()}"
                out.append(
                    Artifact(
                        path=rel,
                        bytes=f.stat().st_size,
                        kind="final" if top == "final" else "checkpoint",
                        url=f"/v1/jobs/{job_id}/artifacts/{rel}",
                    )
                )
    return ArtifactList(data=out)


@router.get("/jobs/{job_id}/artifacts/{path:path}")
def download_artifact(job_id: str, path: str, request: Request) -> FileResponse:
    st = state_of(request)
    st.store.get_job(principal_of(request).tenant, job_id)
    top, _, rest = path.partition("/")
    roots = _artifact_roots(st, job_id)
    if top not in roots or not rest:
        raise NotFound(f"no artifact {path!r}", param="path")
    root = roots[top].resolve()
    target = (root / rest).resolve()
    if not target.is_relative_to(root) or not target.is_file():
        raise NotFound(f"no artifact {path!r}", param="path")
    return FileResponse(target, filename=target.name)


# ---- live events (SSE and websocket), both read the job's Redis stream
async def _owned(request_app: Any, tenant: str, job_id: str) -> dict[str, str]:
    data: dict[str, str] = await request_app.state.redis.hgetall(job_key(job_id))
    if not data or data.get("tenant") != tenant:
        raise NotFound(f"no job with id {job_id!r}", param="job_id")
    return data


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
async def stream_events(job_id: str, request: Request) -> StreamingResponse:
    """Server-sent events: ``status``, ``progress`` (step, total, metrics) and ``log``."""
    tenant = principal_of(request).tenant
    await _owned(request.app, tenant, job_id)
    last = request.headers.get("last-event-id") or "0"

    async def body() -> AsyncIterator[bytes]:
        async for eid, type_, data in job_events(request.app, job_id, last):
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
        await _owned(websocket.app, principal.tenant, job_id)
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
