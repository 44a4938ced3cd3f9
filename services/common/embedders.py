"""Fine-tuned embedders, published per tenant (issue 17).

The trainer's ``embedder`` jobs publish a sentence-transformers folder here; the retrieval
service loads it when a collection switches to it. Both reach the same folder,
``$TANDEM_HOME/models/embedders/<tenant>/<name>/`` (the ``models`` volume in compose and
Kubernetes), with the manifest ``tandem_embedder.json`` beside the model files. A folder
appears whole (written beside, then renamed), so a reader never loads half a model, and a
tenant only ever resolves names under its own folder.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, Field

from services.common.atomic import fsync_path

MANIFEST = "tandem_embedder.json"
PREFIX = "ft-emb-"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class EmbedderManifest(BaseModel):
    """What a published embedder is: its name, owner, lineage and held-out figures."""

    name: str
    tenant: str
    base_model: str
    dim: int = Field(gt=0)
    job_id: str
    created_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat())
    # held-out evaluation before and after training, e.g. {"ndcg@10_before": 0.61, "ndcg@10": 0.66}
    metrics: dict[str, float] = Field(default_factory=dict)


def embedder_name(job_id: str) -> str:
    """The ``fine_tuned_model`` of an embedder job: ``ft-emb-<job>``."""
    return PREFIX + job_id.removeprefix("ftjob-")


def is_embedder_name(name: str) -> bool:
    return name.startswith(PREFIX) and bool(_NAME.match(name))


def embedders_root(home: Path) -> Path:
    return home / "models" / "embedders"


def _tenant_dir(home: Path, tenant: str) -> Path:
    if not _TENANT.match(tenant):
        raise ValueError(f"tenant {tenant!r} is not a safe folder name")
    return embedders_root(home) / tenant


def embedder_dir(home: Path, tenant: str, name: str) -> Path:
    if not _NAME.match(name):
        raise ValueError(f"embedder {name!r} is not a valid name")
    return _tenant_dir(home, tenant) / name


def find_embedder(home: Path, tenant: str, name: str) -> tuple[Path, EmbedderManifest] | None:
    """The folder and manifest of ``tenant``'s embedder ``name``, or None when it has none."""
    try:
        folder = embedder_dir(home, tenant, name)
    except ValueError:
        return None
    try:
        manifest = EmbedderManifest.model_validate_json((folder / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return None
    return folder, manifest


def list_embedders(home: Path, tenant: str) -> list[EmbedderManifest]:
    try:
        folders = sorted(_tenant_dir(home, tenant).iterdir())
    except (OSError, ValueError):
        return []
    found = (find_embedder(home, tenant, f.name) for f in folders if not f.name.startswith("."))
    return [m for hit in found if hit is not None for m in (hit[1],)]


def publish_embedder(home: Path, source: Path, manifest: EmbedderManifest) -> Path:
    """Copy the model folder ``source`` to the tenant's embedders with its manifest, whole or
    not at all; publishing the same name again replaces it."""
    target = embedder_dir(home, manifest.tenant, manifest.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{manifest.name}.", dir=target.parent))
    try:
        shutil.copytree(source, staging, dirs_exist_ok=True)
        (staging / MANIFEST).write_text(manifest.model_dump_json(indent=2))
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
