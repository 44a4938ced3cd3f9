"""Job and file state in Redis hashes (never in Celery's result backend).

Layout (prefix ``tandem:trainer:``)::

    file:<id>            hash  tenant, filename, path, bytes, rows, format, kinds, created_at
    files:<tenant>       zset  file ids by creation time
    job:<id>             hash  tenant, type, status, spec (JSON), queue, step, total, metrics (JSON),
                               error, created_at, started_at, finished_at, attempts, cancel,
                               fine_tuned_model, published, owner, eval (JSON: held-out metrics,
                               merged into metrics), generated_target (embedder jobs' generate_queries:
                               the file id the questions go to), generated_file (that id, once written)
    jobs:<tenant>        zset  job ids by creation time
    job:<id>:metrics     list  JSON metric points, one per step
    job:<id>:logs        list  JSON log lines
    job:<id>:events      stream of {type, data}: status / progress / log / eval, read by SSE and websockets
                         (a progress event of a phase before training names it: {phase, step, total})
    job:<id>:lease       hash  owner, expires (ms on the store's clock): the heartbeat of the worker
                               running it; Redis drops the key an hour after it expires
    active               set   ids of jobs marked running (scanned for dead workers)
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict, cast

import redis

from services.common.errors import Conflict, NotFound
from services.common.leases import Clock, Leases
from services.trainer.metrics import status_totals
from services.trainer.protocol import TERMINAL, ApplyOutcome, Job, JobStatus, JobType, Progress

P = "tandem:trainer:"
EVENTS_MAXLEN = 10_000
LOGS_MAXLEN = 5_000


def file_key(file_id: str) -> str:
    return f"{P}file:{file_id}"


def job_key(job_id: str) -> str:
    return f"{P}job:{job_id}"


def events_key(job_id: str) -> str:
    return f"{P}job:{job_id}:events"


def lease_key(job_id: str) -> str:
    return f"{P}job:{job_id}:lease"


ACTIVE = f"{P}active"


class FileRecord(TypedDict):
    """A dataset file as recorded (the ``file:<id>`` hash, before its values become strings)."""

    id: str
    filename: str
    bytes: int
    rows: int
    format: str
    kinds: list[str]  # the kinds of job it suits
    created_at: float


class LogLine(TypedDict):
    """One of a job's ``logs`` (and the data of its ``log`` event)."""

    time: float
    level: str
    message: str


class StatusData(TypedDict):
    """The data of a job's ``status`` event."""

    status: str
    error: NotRequired[str]


# A job's ``metrics`` point: ``step``, each metric by name, and ``time``.
MetricPoint = dict[str, float]


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(8)}"


def _opt_float(value: str | None) -> float | None:
    return float(value) if value else None


@dataclass(frozen=True)
class JobRecord:
    """A job as the store keeps it (the ``job:<id>`` hash, decoded)."""

    id: str
    tenant: str
    type: JobType
    status: JobStatus
    spec: dict[str, Any]
    queue: str = "cpu"
    step: int = 0
    total: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    created_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    attempts: int = 0
    cancel_requested: bool = False
    fine_tuned_model: str | None = None
    published: bool = False
    model_path: str | None = None
    generated_dataset: str | None = None  # embedder jobs' generate_queries: the file they were saved to
    apply: ApplyOutcome | None = None  # embedder jobs with apply: the decision

    @classmethod
    def from_hash(cls, job_id: str, data: dict[str, str]) -> JobRecord:
        return cls(
            id=job_id,
            tenant=data.get("tenant", ""),
            type=cast(JobType, data["type"]),
            status=cast(JobStatus, data["status"]),
            spec=json.loads(data["spec"]),
            queue=data.get("queue") or "cpu",
            step=int(data.get("step") or 0),
            total=int(data.get("total") or 0),
            metrics=json.loads(data.get("metrics") or "{}"),
            error=data.get("error") or None,
            created_at=float(data["created_at"]),
            started_at=_opt_float(data.get("started_at")),
            finished_at=_opt_float(data.get("finished_at")),
            attempts=int(data.get("attempts") or 0),
            cancel_requested=data.get("cancel") == "1",
            fine_tuned_model=data.get("fine_tuned_model") or None,
            published=data.get("published") == "1",
            model_path=data.get("model_path") or None,
            generated_dataset=data.get("generated_file") or None,
            apply=ApplyOutcome.model_validate_json(data["apply"]) if data.get("apply") else None,
        )

    def to_job(self) -> Job:
        """The API's view of the job."""
        return Job(
            id=self.id,
            type=self.type,
            status=self.status,
            base_model=self.spec["base_model"],
            dataset=self.spec["dataset"],
            eval_dataset=self.spec.get("eval_dataset"),
            collection=self.spec.get("collection"),
            generated_dataset=self.generated_dataset,
            queue=self.queue,
            progress=Progress(step=self.step, total=self.total),
            metrics=self.metrics,
            error=self.error,
            created_at=self.created_at,
            started_at=self.started_at,
            finished_at=self.finished_at,
            attempts=self.attempts,
            fine_tuned_model=self.fine_tuned_model,
            published=self.published,
            request=self.spec,
            applied=self.apply.applied if self.apply else None,
            apply=self.apply,
        )


class TrainerStore:
    def __init__(self, client: redis.Redis, clock: Clock | None = None) -> None:
        self.r = client
        # What leases are timed by (the Redis server's time); tests pass a clock they move by hand.
        self.leases = Leases(client, P, clock)

    @property
    def clock(self) -> Clock:
        return self.leases.clock

    @clock.setter
    def clock(self, clock: Clock) -> None:
        self.leases.clock = clock

    # ---- files
    def add_file(self, tenant: str, record: FileRecord) -> None:
        fid = record["id"]
        data = {k: json.dumps(v) if isinstance(v, list | dict) else str(v) for k, v in record.items()}
        pipe = self.r.pipeline()
        mapping: dict[Any, Any] = {**data, "tenant": tenant}
        pipe.hset(file_key(fid), mapping=mapping)
        pipe.zadd(f"{P}files:{tenant}", {fid: float(record["created_at"])})
        pipe.execute()

    def get_file(self, tenant: str, file_id: str, *, param: str = "file_id") -> dict[str, str]:
        data: dict[str, str] = self.r.hgetall(file_key(file_id))  # type: ignore[assignment]
        if not data or data.get("tenant") != tenant:
            raise NotFound(f"no file with id {file_id!r}", param=param)
        return data

    def list_files(self, tenant: str) -> list[dict[str, str]]:
        ids = self.r.zrevrange(f"{P}files:{tenant}", 0, -1)
        out = []
        for fid in ids:  # type: ignore[union-attr]
            data = self.r.hgetall(file_key(str(fid)))
            if data:
                out.append(data)
        return out  # type: ignore[return-value]

    # ---- jobs
    def create_job(self, tenant: str, job_id: str, fields: dict[str, str]) -> None:
        now = time.time()
        pipe = self.r.pipeline()
        mapping: dict[Any, Any] = {
            **fields,
            "tenant": tenant,
            "status": "queued",
            "step": "0",
            "total": "0",
            "metrics": "{}",
            "created_at": str(now),
            "attempts": "0",
            "cancel": "0",
        }
        pipe.hset(job_key(job_id), mapping=mapping)
        pipe.zadd(f"{P}jobs:{tenant}", {job_id: now})
        pipe.execute()
        self.event(job_id, "status", {"status": "queued"})

    def job(self, job_id: str) -> dict[str, str]:
        """The raw hash (the worker reads and writes single fields of it)."""
        return self.r.hgetall(job_key(job_id))  # type: ignore[return-value]

    def record(self, job_id: str) -> JobRecord:
        return JobRecord.from_hash(job_id, self.job(job_id))

    def get_job(self, tenant: str, job_id: str) -> JobRecord:
        """The tenant's job; another tenant's is as missing as one that never existed."""
        data = self.job(job_id)
        if not data or data.get("tenant") != tenant:
            raise NotFound(f"no job with id {job_id!r}", param="job_id")
        return JobRecord.from_hash(job_id, data)

    def list_jobs(self, tenant: str, limit: int = 100) -> list[JobRecord]:
        ids = self.r.zrevrange(f"{P}jobs:{tenant}", 0, limit - 1)
        out = []
        for jid in ids:  # type: ignore[union-attr]
            data = self.job(str(jid))
            if data:
                out.append(JobRecord.from_hash(str(jid), data))
        return out

    def update(self, job_id: str, **fields: Any) -> None:
        self.r.hset(job_key(job_id), mapping={k: "" if v is None else str(v) for k, v in fields.items()})

    def set_status(self, job_id: str, status: str, *, error: str | None = None, **extra: Any) -> None:
        fields: dict[str, Any] = {"status": status, **extra}
        if error is not None:
            fields["error"] = error
        if status in TERMINAL:
            fields["finished_at"] = time.time()
            self.r.srem(ACTIVE, job_id)
        elif status == "running":
            self.r.sadd(ACTIVE, job_id)
        self.update(job_id, **fields)
        status_totals(self.r).add(**{status: 1})  # tandem_trainer_jobs_total{status}
        payload: StatusData = {"status": status}
        if error:
            payload["error"] = error
        self.event(job_id, "status", payload)

    def request_cancel(self, tenant: str, job_id: str) -> JobRecord:
        job = self.get_job(tenant, job_id)
        if job.status in TERMINAL:
            raise Conflict(f"job {job_id!r} is already {job.status}", param="job_id")
        self.update(job_id, cancel="1")
        if job.status == "queued":
            # Nobody runs it yet: the task will see the terminal status and do nothing.
            self.set_status(job_id, "cancelled")
        self.log(job_id, "cancel requested")
        return self.record(job_id)

    def cancel_requested(self, job_id: str) -> bool:
        return self.r.hget(job_key(job_id), "cancel") == "1"

    # ---- progress, metrics, logs, events
    def progress(self, job_id: str, step: int, total: int, metrics: dict[str, float]) -> None:
        point = {"step": step, **metrics, "time": time.time()}
        held_out = json.loads(str(self.r.hget(job_key(job_id), "eval") or "{}"))
        pipe = self.r.pipeline()
        pipe.hset(
            job_key(job_id),
            mapping={"step": str(step), "total": str(total), "metrics": json.dumps({**metrics, **held_out})},
        )
        pipe.rpush(f"{P}job:{job_id}:metrics", json.dumps(point))
        pipe.execute()
        self.event(job_id, "progress", {"step": step, "total": total, "metrics": metrics})

    def phase_progress(self, job_id: str, phase: str, done: int, total: int) -> None:
        """Progress of a phase before training (``generate_queries``): the job's ``progress``
        counts it until the first training step replaces it, and a ``progress`` event names the
        phase; no metric point (the metrics series is the training's)."""
        self.r.hset(job_key(job_id), mapping={"step": str(done), "total": str(total)})
        self.event(job_id, "progress", {"phase": phase, "step": done, "total": total, "metrics": {}})

    def evaluation(self, job_id: str, phase: str, metrics: dict[str, float]) -> None:
        """Held-out metrics (``eval_*_before`` / ``eval_*_after``): kept in the job's ``metrics``
        from now on (each step's metrics are merged with them) and sent as an ``eval`` event."""
        key = job_key(job_id)
        held_out = {**json.loads(str(self.r.hget(key, "eval") or "{}")), **metrics}
        latest = json.loads(str(self.r.hget(key, "metrics") or "{}"))
        self.r.hset(
            key, mapping={"eval": json.dumps(held_out), "metrics": json.dumps({**latest, **held_out})}
        )
        self.event(job_id, "eval", {"phase": phase, "metrics": metrics})

    def truncate_metrics(self, job_id: str, upto_step: int) -> None:
        """After a resume from step N, forget points past N (they are recomputed)."""
        key = f"{P}job:{job_id}:metrics"
        kept = [p for p in self.metrics(job_id) if p.get("step", 0) <= upto_step]
        pipe = self.r.pipeline()
        pipe.delete(key)
        if kept:
            pipe.rpush(key, *[json.dumps(p) for p in kept])
        pipe.execute()

    def metrics(self, job_id: str) -> list[MetricPoint]:
        return [json.loads(x) for x in self.r.lrange(f"{P}job:{job_id}:metrics", 0, -1)]  # type: ignore[union-attr]

    def log(self, job_id: str, message: str, level: str = "info") -> None:
        line: LogLine = {"time": time.time(), "level": level, "message": message}
        pipe = self.r.pipeline()
        pipe.rpush(f"{P}job:{job_id}:logs", json.dumps(line))
        pipe.ltrim(f"{P}job:{job_id}:logs", -LOGS_MAXLEN, -1)
        pipe.execute()
        self.event(job_id, "log", line)

    def logs(self, job_id: str) -> list[LogLine]:
        return [json.loads(x) for x in self.r.lrange(f"{P}job:{job_id}:logs", 0, -1)]  # type: ignore[union-attr]

    def event(self, job_id: str, type_: str, data: Mapping[str, object]) -> None:
        """Append to the job's event stream; ``data`` is sent as JSON."""
        self.r.xadd(
            events_key(job_id),
            {"type": type_, "data": json.dumps(data)},
            maxlen=EVENTS_MAXLEN,
            approximate=True,
        )

    # ---- leases (heartbeats: services/common/leases.py)
    def acquire_lease(self, job_id: str, owner: str, ttl_s: float) -> bool:
        return self.leases.acquire(job_id, owner, ttl_s)

    def renew_lease(self, job_id: str, owner: str, ttl_s: float) -> bool:
        return self.leases.renew(job_id, owner, ttl_s)

    def release_lease(self, job_id: str, owner: str) -> None:
        self.leases.release(job_id, owner)

    def lease_owner(self, job_id: str) -> str | None:
        """Who holds a live lease on the job, or None when nobody does (or it expired)."""
        return self.leases.owner(job_id)

    def active_jobs(self) -> list[str]:
        return sorted(str(x) for x in self.r.smembers(ACTIVE))  # type: ignore[union-attr]

    def claim_requeue(self, job_id: str, attempt: int) -> bool:
        """Only one worker requeues a given orphaned attempt."""
        return self.leases.claim_requeue(job_id, attempt)
