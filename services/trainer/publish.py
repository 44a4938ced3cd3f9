"""Publishing a finished job to the inference service, so it can be chatted with at once.

An adapter goes to ``POST {inference}/v1/load_lora_adapter {"lora_name", "lora_path",
"tenant"}``; a full model to ``POST {inference}/v1/models/register {"name", "path",
"tenant"}`` (a Tandem extension). Both with ``TANDEM_SERVICE_API_KEY`` (an operator key:
those routes are operator-only) and ``tenant`` = the job's tenant, so the fine-tune is
that tenant's alone and is recorded durably (every inference replica serves it). An
adapter trained on one of the tenant's full fine-tunes names it as ``base``. The artifact
folder lies under ``$TANDEM_HOME/models``, inside the inference service's default roots.

Before a ``publish: true`` job is queued, :func:`capabilities` asks the inference service
what it can serve, so a job it could not serve is refused before it trains.

Embedders and readers are not sent anywhere: their folders are copied under
``$TANDEM_HOME/models/{embedders,readers}/`` (``services/common/published_models.py``), where
the retrieval service (embedders) and the inference service's ``/v1/rerank`` (readers) find
them by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from services.common.config import CommonSettings
from services.common.errors import InvalidRequest, ServiceUnavailable
from services.common.replicas import replica_pool, request_sync
from services.common.upstream import UpstreamReply
from services.trainer.protocol import JobCreate

# the job types whose models are published as folders under $TANDEM_HOME/models, not registered
FILE_PUBLISHED = ("embedder", "reader")


class PublishError(RuntimeError):
    pass


def published_name(job_id: str) -> str:
    return f"ft-{job_id.removeprefix('ftjob-')}"


def _headers(common: CommonSettings) -> dict[str, str]:
    return {"Authorization": f"Bearer {common.service_api_key}"}


def _job(common: CommonSettings, job_id: str) -> dict[str, str]:
    from services.common.redis_conn import sync_redis
    from services.trainer.store import TrainerStore

    client = sync_redis(common.redis_url)
    try:
        return TrainerStore(client).job(job_id)
    finally:
        client.close()


def _adapter_base(common: CommonSettings, model_path: str, job: dict[str, str]) -> str | None:
    """The registered model an adapter applies to when it was trained on a full fine-tune
    (its weights under models/trainer/<job>); None: the served base model."""
    if not model_path:
        return None
    trainer_root = (common.home_dir / "models" / "trainer").resolve()
    path = Path(model_path).resolve()
    if not path.is_relative_to(trainer_root) or path == trainer_root:
        return None
    parent = _job(common, path.relative_to(trainer_root).parts[0])
    name = parent.get("fine_tuned_model") or ""
    if not name or parent.get("tenant") != job.get("tenant"):
        raise PublishError(
            f"the adapter was trained on the full fine-tune in {model_path}, which is not published; publish that first"
        )
    return name


def publish(common: CommonSettings, job_id: str, spec: JobCreate, path: Path, timeout: float = 120.0) -> str:
    if not common.service_api_key:
        raise PublishError("publish needs TANDEM_SERVICE_API_KEY (a key the inference service accepts)")
    job = _job(common, job_id)
    tenant = job.get("tenant") or ""
    name = published_name(job_id)
    body: dict[str, str]  # the route's fields, all strings
    if spec.lora is not None:
        route, body = "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}
        adapter_base = _adapter_base(common, job.get("model_path", ""), job)
        if adapter_base:
            body["base"] = adapter_base
    else:
        route, body = "/v1/models/register", {"name": name, "path": str(path)}
    if tenant:
        body["tenant"] = tenant
    # one replica records it in the durable registry, and every replica serves it from there;
    # sent again elsewhere only if it never reached the first (a second load would be a 409)
    pool = replica_pool(common.inference_replicas())
    try:
        resp = request_sync(
            pool, "POST", route, idempotent=False, json=body, headers=_headers(common), timeout=timeout
        )
    except httpx.HTTPError as exc:
        raise PublishError(f"inference service at {', '.join(pool.urls)} unreachable: {exc}") from None
    if resp.status_code >= 400:
        reply = UpstreamReply.of("inference", resp)
        raise PublishError(
            f"inference service refused {resp.request.url}: {resp.status_code} {reply.message}"
        )
    return name


def capabilities(common: CommonSettings, timeout: float = 10.0) -> dict[str, Any]:
    """``GET {inference}/v1/capabilities``; a 503 naming ``publish`` when it cannot be asked
    (a job that would fail only after training is refused now, not an hour later)."""
    pool = replica_pool(common.inference_replicas())
    base = ", ".join(pool.urls)
    if not common.service_api_key:
        raise ServiceUnavailable(
            "publish: TANDEM_SERVICE_API_KEY is not set, so the trainer cannot publish to the inference service",
            param="publish",
        )
    try:
        resp = request_sync(pool, "GET", "/v1/capabilities", headers=_headers(common), timeout=timeout)
    except httpx.HTTPError as exc:
        raise ServiceUnavailable(
            f"publish: the inference service at {base} is unreachable ({exc}); retry when it is up, "
            "or start the job with publish: false",
            param="publish",
        ) from None
    if resp.status_code != 200:
        raise ServiceUnavailable(
            f"publish: the inference service at {base} answered {resp.status_code} to /v1/capabilities",
            param="publish",
        )
    data: dict[str, Any] = resp.json()
    return data


def check_publishable(common: CommonSettings, spec: JobCreate, lora_rank: int | None) -> None:
    """Refuse (400) a ``publish: true`` job the inference engine could not serve."""
    if not spec.publish or spec.type in FILE_PUBLISHED:  # copied to the models folder: nothing to ask
        return
    caps = capabilities(common)
    engine = caps.get("engine", "?")
    if spec.lora is not None:
        if not caps.get("adapters"):
            raise InvalidRequest(
                f"publish: the inference engine ({engine}) cannot serve LoRA adapters; "
                "train without publish, or a full fine-tune",
                param="publish",
            )
        cap = caps.get("max_lora_rank")
        if cap is not None and lora_rank is not None and lora_rank > int(cap):
            raise InvalidRequest(
                f"lora.r {lora_rank} is above the inference engine's ({engine}) max_lora_rank {cap}; "
                f"use lora.r <= {cap} or publish: false",
                param="lora.r",
            )
    elif not caps.get("register_models"):
        raise InvalidRequest(
            f"publish: the inference engine ({engine}) cannot serve further full models; "
            "train a LoRA adapter instead, or publish: false",
            param="publish",
        )


def publish_embedder_job(
    common: CommonSettings, tenant: str, job_id: str, spec: JobCreate, path: Path
) -> str:
    """An embedder job's model folder, published as the tenant's ``ft-emb-<job>`` with its
    dimension and held-out figures in the manifest (``ndcg@10_before``, ``ndcg@10``, ...):
    the retrieval service finds it there by name when a collection switches to it."""
    from services.common.embedders import EmbedderManifest, embedder_name, publish_embedder
    from services.common.published_models import held_out_figures

    info = json.loads((path / "tandem_training.json").read_text())
    manifest = EmbedderManifest(
        name=embedder_name(job_id),
        tenant=tenant,
        base_model=spec.base_model,
        dim=int(info["dim"]),
        job_id=job_id,
        metrics=held_out_figures(info.get("final_metrics") or {}),
    )
    publish_embedder(common.home_dir, path, manifest)
    return manifest.name


def publish_reader_job(common: CommonSettings, tenant: str, job_id: str, spec: JobCreate, path: Path) -> str:
    """A reader job's cross-encoder folder, published as ``ft-reader-<job>`` for its tenant (or,
    with ``shared``, for every tenant) with its held-out figures (``auc_before``, ``auc``,
    ``mrr``, ...) and its max-F1 threshold in the manifest: the inference service's
    ``/v1/rerank`` finds it there by name."""
    from services.common.published_models import held_out_figures
    from services.common.readers import SHARED, ReaderManifest, publish_reader, reader_name

    info = json.loads((path / "tandem_training.json").read_text())
    figures = held_out_figures(info.get("final_metrics") or {})
    threshold = figures.pop("threshold", None)
    figures.pop("threshold_before", None)
    manifest = ReaderManifest(
        name=spec.name or reader_name(job_id),
        tenant=SHARED if spec.shared else tenant,
        base_model=spec.base_model,
        job_id=job_id,
        metrics=figures,
        kind="bi-encoder" if spec.reader_kind == "bi-encoder" else "cross-encoder",
        threshold=threshold,
    )
    publish_reader(common.home_dir, path, manifest)
    return manifest.name
