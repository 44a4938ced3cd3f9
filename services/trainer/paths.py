"""Where the trainer keeps a job's work, its final weights and the tenants' dataset files."""

from __future__ import annotations

from pathlib import Path

from services.common.config import CommonSettings


def job_dir(common: CommonSettings, job_id: str) -> Path:
    return common.home_dir / "trainer" / "jobs" / job_id


def artifact_dir(common: CommonSettings, job_id: str) -> Path:
    # Under $TANDEM_HOME/models, the inference service's default model root, so it can load it.
    return common.home_dir / "models" / "trainer" / job_id


def dataset_path(common: CommonSettings, tenant: str, file_id: str) -> Path:
    return common.home_dir / "trainer" / "files" / tenant / f"{file_id}.jsonl"
