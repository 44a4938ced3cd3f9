"""Model folders the trainer publishes per tenant, and the services that load them find by name.

Fine-tuned embedders (``embedders.py``) and readers (``readers.py``) are both a model folder
copied whole under ``$TANDEM_HOME/models/<kind>/<tenant>/<name>/`` (the ``models`` volume in
compose and Kubernetes) with a JSON manifest beside the model files. A :class:`ModelShelf`
is one such kind: it publishes a folder atomically (written beside, then renamed, so a loader
never sees half a model) and resolves a name under one tenant's folder only, so a tenant
never reaches another's models by name or by path.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Generic, TypeVar

from pydantic import BaseModel, Field

from services.common.atomic import fsync_path

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class PublishedManifest(BaseModel):
    """What every published model says about itself: name, owner folder, lineage, figures."""

    name: str
    tenant: str
    base_model: str
    job_id: str
    created_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat())
    # held-out evaluation before and after training, e.g. {"ndcg@10_before": 0.61, "ndcg@10": 0.66}
    metrics: dict[str, float] = Field(default_factory=dict)


M = TypeVar("M", bound=PublishedManifest)


def is_safe_name(name: str) -> bool:
    return bool(_NAME.match(name))


def held_out_figures(final_metrics: dict[str, object]) -> dict[str, float]:
    """A job's held-out metrics as a manifest keeps them: ``eval_ndcg@10_before`` ->
    ``ndcg@10_before``, ``eval_ndcg@10_after`` -> ``ndcg@10`` (the published model's own)."""
    return {
        key.removeprefix("eval_").removesuffix("_after"): float(value)
        for key, value in final_metrics.items()
        if key.startswith("eval_") and isinstance(value, int | float) and not isinstance(value, bool)
    }


@dataclass(frozen=True)
class ModelShelf(Generic[M]):
    """One kind of published model: ``models/<folder>/<tenant>/<name>/`` with ``manifest``."""

    folder: str
    manifest: str
    manifest_type: type[M]
    # the folder of models every tenant may use (None: none); it starts with "_", which no
    # tenant name does (auth.validate_tenant), so it can never be a tenant's own folder
    shared: str | None = None

    def root(self, home: Path) -> Path:
        return home / "models" / self.folder

    def tenant_dir(self, home: Path, tenant: str) -> Path:
        if tenant != self.shared and not _TENANT.match(tenant):
            raise ValueError(f"tenant {tenant!r} is not a safe folder name")
        return self.root(home) / tenant

    def model_dir(self, home: Path, tenant: str, name: str) -> Path:
        if not _NAME.match(name):
            raise ValueError(f"{self.folder} name {name!r} is not a valid name")
        return self.tenant_dir(home, tenant) / name

    def find(self, home: Path, tenant: str, name: str) -> tuple[Path, M] | None:
        """The folder and manifest of ``name`` in ``tenant``'s folder, or None."""
        try:
            folder = self.model_dir(home, tenant, name)
            manifest = self.manifest_type.model_validate_json((folder / self.manifest).read_bytes())
        except (OSError, ValueError):
            return None
        return folder, manifest

    def list(self, home: Path, tenant: str) -> list[M]:
        try:
            folders = sorted(self.tenant_dir(home, tenant).iterdir())
        except (OSError, ValueError):
            return []
        found = (self.find(home, tenant, f.name) for f in folders if not f.name.startswith("."))
        return [hit[1] for hit in found if hit is not None]

    def publish(self, home: Path, source: Path, manifest: M) -> Path:
        """Copy the model folder ``source`` to ``manifest.tenant``'s folder with its manifest,
        whole or not at all; publishing the same name again replaces it."""
        target = self.model_dir(home, manifest.tenant, manifest.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{manifest.name}.", dir=target.parent))
        try:
            shutil.copytree(source, staging, dirs_exist_ok=True)
            (staging / self.manifest).write_text(manifest.model_dump_json(indent=2))
            for f in staging.rglob("*"):
                if f.is_file():
                    fsync_path(f)
            if target.exists():  # a rename can't replace a non-empty folder: move the old one aside
                old = target.with_name(f".{manifest.name}.old")
                shutil.rmtree(old, ignore_errors=True)
                target.rename(old)
                staging.rename(target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                staging.rename(target)
            fsync_path(target.parent)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return target
