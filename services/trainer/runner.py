"""Running a job inside a worker: idempotent, heartbeated, resumable.

``execute(job_id)`` is the body of the Celery task. It may be delivered twice (a
recovered job, then the original unacked message once the broker's visibility
timeout passes), so it first takes the job's *lease* (a Redis key with a TTL that
a heartbeat thread renews): a job in a terminal state, or whose lease another live
worker holds, is left alone. Training always resumes from the job's latest
checkpoint, so a re-run after a crash continues instead of starting over and ends
at the same step count.

An embedder job with ``generate_queries`` first writes its questions (``questions``), with
progress, cancel and resume of its own, then trains on them.

Recovery (``recover_orphans``): a worker killed with ``kill -9`` leaves its job
``running`` with a lease that nobody renews. When the lease has expired, any worker
(at start-up and then periodically) puts the job back on its queue; exactly one of
them does, thanks to a per-attempt claim in Redis. The task's unacked message is not
relied on: with the Redis transport it would only come back after the visibility
timeout, which has to be longer than the longest job.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from services.common.config import CommonSettings
from services.common.leases import Heartbeat
from services.common.telemetry import set_attributes, span
from services.trainer import chunk_pairs
from services.trainer.config import TrainerSettings
from services.trainer.hooks import JobHooks, LeaseLost
from services.trainer.jobspec import PAD_MULTIPLE, JobOwner, ResolvedJob, validate_embedder_job, validate_job
from services.trainer.paths import artifact_dir, dataset_path, job_dir
from services.trainer.protocol import TERMINAL, JobCreate, recipe_kind
from services.trainer.recipes.base import Recipe, TrainConfig, run
from services.trainer.store import TrainerStore

log = logging.getLogger("tandem.trainer.runner")

Dispatch = Callable[[str, str], None]  # (job_id, queue)
Join = Callable[[str, str, str, str], None]  # (job_id, endpoint, rdzv_id, queue): another machine joins


def recipe_for(kind: str) -> type[Recipe]:
    from services.trainer.recipes.dpo import DPORecipe
    from services.trainer.recipes.embedder import EmbedderRecipe
    from services.trainer.recipes.kto import KTORecipe
    from services.trainer.recipes.reader import ReaderRecipe
    from services.trainer.recipes.reader_bi import BiEncoderReaderRecipe
    from services.trainer.recipes.reader_features import FeatureReaderRecipe
    from services.trainer.recipes.rl import GRPORecipe, PPORecipe
    from services.trainer.recipes.sft import SFTRecipe

    return {
        "sft": SFTRecipe,
        "dpo": DPORecipe,
        "simpo": DPORecipe,
        "orpo": DPORecipe,
        "kto": KTORecipe,
        "ppo": PPORecipe,
        "grpo": GRPORecipe,
        "embedder": EmbedderRecipe,
        "reader": ReaderRecipe,
        "reader-features": FeatureReaderRecipe,
        "reader-bi": BiEncoderReaderRecipe,
    }[kind]


def execute(
    job_id: str,
    *,
    store: TrainerStore,
    common: CommonSettings,
    settings: TrainerSettings,
    owner: str | None = None,
    publish: Callable[[str, JobCreate, Path], str | None] | None = None,
    join: Join | None = None,
) -> str:
    """Run (or resume) job ``job_id`` under its lease; its outcome. ``publish`` serves a finished
    job's model, ``join`` asks another machine to take part in a multi-node job."""
    owner = owner or f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}:{time.time_ns()}"
    data = store.job(job_id)
    if not data:
        log.warning("job %s does not exist", job_id)
        return "missing"
    if data["status"] in TERMINAL:
        return data["status"]
    if not store.acquire_lease(job_id, owner, settings.stale_after_s):
        log.info("job %s is held by %s; not running it twice", job_id, store.lease_owner(job_id))
        return "duplicate"
    try:
        data = store.job(job_id)
        if data["status"] in TERMINAL:  # cancelled between the two reads
            return data["status"]
        attempts = int(data.get("attempts") or 0) + 1
        store.set_status(
            job_id,
            "running",
            started_at=data.get("started_at") or time.time(),
            attempts=attempts,
            owner=owner,
            heartbeat=time.time(),
        )

        def beat(reacquired: bool) -> None:
            if reacquired and store.job(job_id).get("status") == "queued":
                store.set_status(job_id, "running")
            store.update(job_id, heartbeat=time.time())

        heart = Heartbeat(
            store.leases, job_id, owner, settings.stale_after_s, settings.heartbeat_interval_s, beat
        )
        with heart as running:
            outcome = _train(
                job_id, data, store, common, settings, running.lost, publish, owner, attempts, join
            )
        return outcome
    except LeaseLost:
        log.warning("job %s: lease lost, another worker continues it", job_id)
        return "lease-lost"
    finally:
        store.release_lease(job_id, owner)


def _train(
    job_id: str,
    data: dict[str, str],
    store: TrainerStore,
    common: CommonSettings,
    settings: TrainerSettings,
    lost: threading.Event,
    publish: Callable[[str, JobCreate, Path], str | None] | None,
    owner: str = "",
    attempt: int = 1,
    join: Join | None = None,
) -> str:
    """Questions (when asked for), training, then the artifact saved and published; the outcome.
    Any error but a lost lease fails the job with its message."""
    tenant = data["tenant"]
    try:
        spec = JobCreate.model_validate_json(data["spec"])
        with_questions = _generate_questions(job_id, spec, data, store, common, settings, lost)
        if with_questions is None:
            store.set_status(job_id, "cancelled")
            return "cancelled"
        data = with_questions
        resolved = _resolve(spec, data, common, settings, JobOwner(tenant, store))
        work = job_dir(common, job_id)
        cfg = _train_config(spec, resolved, work, settings)
        out = artifact_dir(common, job_id)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        queue = data.get("queue") or "cpu"
        join_job = None if join is None else lambda jid, endpoint, rdzv: join(jid, endpoint, rdzv, queue)
        outcome = _run_steps(job_id, spec, cfg, work, tmp, store, settings, lost, owner, attempt, join_job)
        if outcome == "cancelled":
            store.set_status(job_id, "cancelled")
            return "cancelled"
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        store.log(job_id, f"saved {'adapter' if spec.lora else 'model'} to {out}")
        name = _publish_result(job_id, tenant, spec, out, resolved, store, common, lost, publish)
        store.set_status(
            job_id,
            "succeeded",
            fine_tuned_model=name or "",
            published="1" if name else "0",
            artifact_path=str(out),
        )
        return "succeeded"
    except LeaseLost:
        raise
    except Exception as exc:
        message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
        store.log(job_id, "failed:\n" + traceback.format_exc(limit=8), level="error")
        store.set_status(job_id, "failed", error=f"{type(exc).__name__}: {message}")
        return "failed"


def _generate_questions(
    job_id: str,
    spec: JobCreate,
    data: dict[str, str],
    store: TrainerStore,
    common: CommonSettings,
    settings: TrainerSettings,
    lost: threading.Event,
) -> dict[str, str] | None:
    """The job's record with ``generated_file`` once its questions are written (the first phase
    of an embedder job with ``generate_queries``; a resumed job asks only what is not kept);
    ``data`` itself when there is nothing to generate; None when the job was cancelled meanwhile."""
    target = data.get("generated_target")
    if spec.generate_queries is None or not target or data.get("generated_file"):
        return data
    from services.trainer.questions import questions_dir, write_questions

    with span("train.generate_queries", job_id=job_id):
        made = write_questions(
            job_id,
            data["tenant"],
            spec.generate_queries,
            spec.hyperparameters.seed,
            target,
            root=questions_dir(job_dir(common, job_id)),
            store=store,
            common=common,
            settings=settings,
            should_stop=JobHooks(store, job_id, lost).should_stop,
        )
    return None if made is None else {**data, "generated_file": made}


def _train_config(
    spec: JobCreate, resolved: ResolvedJob, work: Path, settings: TrainerSettings
) -> TrainConfig:
    """What the recipe trains on: the resolved job, its reward model loaded, and for an embedder
    job over a collection the chunk pairs prepared at submission (services/trainer/chunk_pairs.py)."""
    reward = resolved.reward
    if isinstance(reward, Path):
        from services.trainer.rewards import RewardModel

        reward = RewardModel(reward)
    records, chunks = resolved.records, None
    if spec.type == "embedder" and chunk_pairs.wanted(spec):
        prepared = chunk_pairs.load(work)
        records = chunk_pairs.with_negatives(records, prepared)
        chunks = prepared.chunks if spec.positives == "chunks" else None
    return TrainConfig(
        kind=spec.type,
        model_path=resolved.model_path,
        records=records,
        eval_records=resolved.eval_records,
        hp=spec.hyperparameters,
        lora=spec.lora,
        packing=spec.packing,
        max_tokens_per_pack=resolved.capacity,
        pad_to_multiple_of=PAD_MULTIPLE,
        reward=reward,
        checkpoint_every=spec.hyperparameters.checkpoint_every or settings.checkpoint_every,
        keep_checkpoints=settings.keep_checkpoints,
        work_dir=work,
        init_adapter=resolved.lineage.init_adapter if resolved.lineage else None,
        corpus=resolved.corpus,
        chunks=chunks,
        stages=spec.stages or "together",
    )


def _run_steps(
    job_id: str,
    spec: JobCreate,
    cfg: TrainConfig,
    work: Path,
    tmp: Path,
    store: TrainerStore,
    settings: TrainerSettings,
    lost: threading.Event,
    owner: str,
    attempt: int,
    join: Callable[[str, str, str], None] | None,
) -> str:
    """The training steps, in this process or under torchrun when ``spec.resources`` asks for
    several (``join``: another machine asked to take part); a successful run leaves the final
    weights in ``tmp``. The outcome."""
    if spec.resources is not None:
        from services.trainer.launch import run_distributed

        return run_distributed(
            job_id,
            cfg,
            spec.resources,
            work=work,
            artifact_tmp=tmp,  # rank 0 saves the final weights there
            owner=owner,
            attempt=attempt,
            settings=settings,
            lost=lost,
            join=join,
        )
    recipe = recipe_for(recipe_kind(spec.type, spec.reader_kind))(cfg, hooks=JobHooks(store, job_id, lost))
    with span("train.steps", job_id=job_id, kind=spec.type) as current:
        outcome = run(recipe, work / "checkpoints")
        set_attributes(current, outcome=outcome)
    if outcome == "succeeded":
        recipe.save_final(tmp)
    return outcome


def _publish_result(
    job_id: str,
    tenant: str,
    spec: JobCreate,
    out: Path,
    resolved: ResolvedJob,
    store: TrainerStore,
    common: CommonSettings,
    lost: threading.Event,
    publish: Callable[[str, JobCreate, Path], str | None] | None,
) -> str | None:
    """Serve a finished job's model as ``spec.publish`` asks; the name it is served under."""
    name = None
    if spec.publish and spec.type == "embedder":
        # a file copy under $TANDEM_HOME/models/embedders/<tenant>/: no service to call
        from services.trainer.publish import publish_embedder_job

        name = publish_embedder_job(common, tenant, job_id, spec, out)
        store.log(job_id, f"published as {name!r}")
        if spec.apply and spec.collection:
            from services.trainer.apply import apply_embedder

            with span("train.apply", job_id=job_id, collection=spec.collection):
                apply_embedder(
                    job_id,
                    tenant,
                    spec.collection,
                    name,
                    resolved.eval_records or [],
                    store=store,
                    common=common,
                    keep_going=JobHooks(store, job_id, lost).should_stop,
                )
    elif spec.publish and spec.type == "reader":
        # a file copy under $TANDEM_HOME/models/readers/<tenant or _shared>/, served by /v1/rerank
        from services.trainer.publish import publish_reader_job

        name = publish_reader_job(common, tenant, job_id, spec, out)
        store.log(job_id, f"published as {name!r}" + (" for every tenant" if spec.shared else ""))
    elif spec.publish and publish is not None:
        with span("train.publish", job_id=job_id):
            name = publish(job_id, spec, out)  # its call to inference carries the trace
        store.log(job_id, f"published as {name!r}")
    return name


def _resolve(
    spec: JobCreate, data: dict[str, str], common: CommonSettings, settings: TrainerSettings, owner: JobOwner
) -> ResolvedJob:
    tenant = owner.tenant
    eval_path = dataset_path(common, tenant, spec.eval_dataset) if spec.eval_dataset else None
    assert spec.dataset is not None  # filled in at submission (a collection's snapshot)
    if spec.type == "embedder":
        snapshot, generated = data.get("collection_file"), data.get("generated_file")
        if generated == spec.dataset:  # a collection without titles: the questions are the dataset
            generated = None
        return validate_embedder_job(
            spec,
            dataset_path(common, tenant, spec.dataset),
            eval_path,
            common,
            owner,
            dataset_path(common, tenant, snapshot) if snapshot else None,
            dataset_path(common, tenant, generated) if generated else None,
        )
    return validate_job(spec, dataset_path(common, tenant, spec.dataset), eval_path, common, settings, owner)


def recover_orphans(store: TrainerStore, settings: TrainerSettings, dispatch: Dispatch) -> list[str]:
    """Requeue running jobs whose heartbeat (lease) has expired; fail those requeued too often."""
    requeued = []
    for job_id in store.active_jobs():
        data = store.job(job_id)
        if not data or data.get("status") != "running":
            store.r.srem("tandem:trainer:active", job_id)
            continue
        if store.lease_owner(job_id) is not None:
            continue  # alive
        attempts = int(data.get("attempts") or 0)
        if not store.claim_requeue(job_id, attempts):
            continue  # another worker already requeued this attempt
        if attempts > settings.max_recoveries:
            store.set_status(job_id, "failed", error=f"worker lost {attempts} times; giving up")
            continue
        store.log(
            job_id,
            f"worker of attempt {attempts} stopped heartbeating; requeued to resume from its last checkpoint",
            level="warning",
        )
        store.set_status(job_id, "queued")
        dispatch(job_id, data.get("queue") or "cpu")
        requeued.append(job_id)
    return requeued
