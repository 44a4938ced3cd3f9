"""Job and file state in Redis hashes (never in Celery's result backend).

Layout (prefix ``tandem:trainer:``)::

    file:<id>            hash  tenant, filename, path, bytes, rows, format, kinds, created_at
    files:<tenant>       zset  file ids by creation time
    job:<id>             hash  tenant, type, status, spec (JSON), queue, step, total, metrics (JSON),
                               error, created_at, started_at, finished_at, attempts, cancel,
                               fine_tuned_model, published, owner, eval (JSON: held-out metrics,
                               merged into metrics)
    jobs:<tenant>        zset  job ids by creation time
    job:<id>:metrics     list  JSON metric points, one per step
    job:<id>:logs        list  JSON log lines
    job:<id>:events      stream of {type, data}: status / progress / log / eval, read by SSE and websockets
    job:<id>:lease       string owner token with a TTL: the heartbeat of the worker running it
    active               set   ids of jobs marked running (scanned for dead workers)
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import redis

from services.common.errors import Conflict, NotFound
from services.trainer.protocol import TERMINAL

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

# Refresh the lease only while we still own it (a recovered job may have a new owner).
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(8)}"


class TrainerStore:
    def __init__(self, client: redis.Redis) -> None:
        self.r = client

    # ---- files
    def add_file(self, tenant: str, record: dict[str, Any]) -> None:
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
        return self.r.hgetall(job_key(job_id))  # type: ignore[return-value]

    def get_job(self, tenant: str, job_id: str) -> dict[str, str]:
        data = self.job(job_id)
        if not data or data.get("tenant") != tenant:
            raise NotFound(f"no job with id {job_id!r}", param="job_id")
        return data

    def list_jobs(self, tenant: str, limit: int = 100) -> list[tuple[str, dict[str, str]]]:
        ids = self.r.zrevrange(f"{P}jobs:{tenant}", 0, limit - 1)
        out = []
        for jid in ids:  # type: ignore[union-attr]
            data = self.job(str(jid))
            if data:
                out.append((str(jid), data))
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
        payload: dict[str, Any] = {"status": status}
        if error:
            payload["error"] = error
        self.event(job_id, "status", payload)

    def request_cancel(self, tenant: str, job_id: str) -> dict[str, str]:
        data = self.get_job(tenant, job_id)
        if data["status"] in TERMINAL:
            raise Conflict(f"job {job_id!r} is already {data['status']}", param="job_id")
        self.update(job_id, cancel="1")
        if data["status"] == "queued":
            # Nobody runs it yet: the task will see the terminal status and do nothing.
            self.set_status(job_id, "cancelled")
        self.log(job_id, "cancel requested")
        return self.job(job_id)

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

    def metrics(self, job_id: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.r.lrange(f"{P}job:{job_id}:metrics", 0, -1)]  # type: ignore[union-attr]

    def log(self, job_id: str, message: str, level: str = "info") -> None:
        line = {"time": time.time(), "level": level, "message": message}
        pipe = self.r.pipeline()
        pipe.rpush(f"{P}job:{job_id}:logs", json.dumps(line))
        pipe.ltrim(f"{P}job:{job_id}:logs", -LOGS_MAXLEN, -1)
        pipe.execute()
        self.event(job_id, "log", line)

    def logs(self, job_id: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.r.lrange(f"{P}job:{job_id}:logs", 0, -1)]  # type: ignore[union-attr]

    def event(self, job_id: str, type_: str, data: dict[str, Any]) -> None:
        self.r.xadd(
            events_key(job_id),
            {"type": type_, "data": json.dumps(data)},
            maxlen=EVENTS_MAXLEN,
            approximate=True,
        )

    # ---- leases (heartbeats)
    def acquire_lease(self, job_id: str, owner: str, ttl_s: float) -> bool:
        return bool(self.r.set(lease_key(job_id), owner, nx=True, px=int(ttl_s * 1000)))

    def renew_lease(self, job_id: str, owner: str, ttl_s: float) -> bool:
        return bool(self.r.eval(_RENEW, 1, lease_key(job_id), owner, int(ttl_s * 1000)))

    def release_lease(self, job_id: str, owner: str) -> None:
        if self.r.get(lease_key(job_id)) == owner:
            self.r.delete(lease_key(job_id))

    def lease_owner(self, job_id: str) -> str | None:
        v = self.r.get(lease_key(job_id))
        return None if v is None else str(v)

    def active_jobs(self) -> list[str]:
        return sorted(str(x) for x in self.r.smembers(ACTIVE))  # type: ignore[union-attr]

    def claim_requeue(self, job_id: str, attempt: int) -> bool:
        """Only one worker requeues a given orphaned attempt."""
        return bool(self.r.set(f"{P}job:{job_id}:requeue:{attempt}", "1", nx=True, ex=24 * 3600))
