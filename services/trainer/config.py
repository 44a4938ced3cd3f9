"""Settings of the trainer service (env prefix ``TANDEM_TRAINER_``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.config import TenantQuotaSettings
from services.common.ratelimit import TenantLimitSettings


class TrainerSettings(TenantLimitSettings, TenantQuotaSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_TRAINER_", extra="ignore")

    max_dataset_mb: int = Field(200, ge=1, description="Largest dataset file POST /v1/files accepts, in MiB.")
    max_dataset_rows: int = Field(1_000_000, ge=1, description="Most rows a dataset file may hold.")
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
    heartbeat_interval_s: float = Field(
        5.0, gt=0, description="How often a running job refreshes its heartbeat in Redis."
    )
    stale_after_s: float = Field(
        30.0,
        gt=0,
        description="A running job whose heartbeat is older than this is taken as orphaned (its worker died) and requeued.",
    )
    recovery_interval_s: float = Field(
        15.0, gt=0, description="How often each worker scans for orphaned jobs to requeue."
    )
    max_recoveries: int = Field(
        3, ge=0, description="How many times a job is requeued after its worker died before it is failed."
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
