"""Settings of the trainer service (env prefix ``TANDEM_TRAINER_``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.config import TenantQuotaSettings
from services.common.leases import JobLeaseSettings
from services.common.ratelimit import TenantLimitSettings


class TrainerSettings(TenantLimitSettings, TenantQuotaSettings, JobLeaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_TRAINER_", extra="ignore")

    max_dataset_mb: int = Field(200, ge=1, description="Largest dataset file POST /v1/files accepts, in MiB.")
    max_dataset_rows: int = Field(1_000_000, ge=1, description="Most rows a dataset file may hold.")
    max_generated_queries: int = Field(
        20_000,
        ge=1,
        description="Most passages an embedder job's generate_queries may ask questions for: a sanity bound "
        "(the job's worker writes them, one chat completion each, before it trains; POST /v1/jobs only "
        "samples them and asks the first).",
    )
    query_generation_concurrency: int = Field(
        4,
        ge=1,
        le=256,
        description="Requests in flight to the inference service while a worker writes generate_queries (also "
        "the batch between which it keeps the replies, reports progress and honours cancel).",
    )
    query_generation_retries: int = Field(
        4,
        ge=0,
        le=20,
        description="How often a worker writing generate_queries asks again when the inference service is busy "
        "(429), unavailable (502-504) or unreachable, after its Retry-After or 1, 2, 4 ... seconds (at most "
        "30), before the job fails.",
    )
    default_max_tokens_per_pack: int = Field(
        4096, ge=64, description="Pack size used when a job does not set max_tokens_per_pack."
    )
    max_tokens_per_pack_limit: int = Field(
        131072,
        ge=64,
        description="Largest max_tokens_per_pack a job may ask for (128K fits a GPU with checkpointing).",
    )
    checkpoint_every: int = Field(
        50, ge=1, description="Default number of optimizer steps between checkpoints (a job may override it)."
    )
    keep_checkpoints: int = Field(
        2, ge=1, description="How many most recent checkpoints a job keeps on disk."
    )
    default_queue: str = Field(
        "cpu",
        pattern="^(cpu|gpu|npu)$",
        description="Celery queue of jobs that do not name one (cpu, gpu or npu).",
    )
    base_models: str = Field(
        "SmolLM2-135M-Instruct",
        description="Comma-separated model names accepted as base_model besides folders/GGUF files under TANDEM_MODEL_ROOTS.",
    )
    max_nodes: int = Field(
        16,
        ge=1,
        description="Largest resources.nodes a job may ask for (each node is a worker of the job's queue).",
    )
    max_procs_per_node: int = Field(
        0,
        ge=0,
        description="Largest resources.procs_per_node a job may ask for, checked at submission; 0: not checked "
        "there (the worker still refuses more processes than its GPUs, or CPU cores on the cpu queue, at launch).",
    )
    dist_max_restarts: int = Field(
        3,
        ge=0,
        description="How many times torchrun restarts a distributed job's ranks after one dies; they resume "
        "from the last checkpoint.",
    )
    rdzv_host: str = Field(
        "",
        description="Address other machines reach this worker on for a multi-node job's c10d rendezvous; "
        "empty: this machine's host name.",
    )
    rdzv_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long a multi-node job waits for all its machines to join the rendezvous.",
    )
