"""Fine-tuned embedders, published per tenant (issue 17).

The trainer's ``embedder`` jobs publish a sentence-transformers folder here; the retrieval
service loads it when a collection switches to it. Both reach the same folder,
``$TANDEM_HOME/models/embedders/<tenant>/<name>/`` (the ``models`` volume in compose and
Kubernetes), with the manifest ``tandem_embedder.json`` beside the model files. A folder
appears whole (written beside, then renamed), so a reader never loads half a model, and a
tenant only ever resolves names under its own folder (``published_models.ModelShelf``).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from services.common.published_models import ModelShelf, PublishedManifest, is_safe_name

MANIFEST = "tandem_embedder.json"
PREFIX = "ft-emb-"


class EmbedderManifest(PublishedManifest):
    """What a published embedder is: its name, owner, lineage, dimension and held-out figures."""

    dim: int = Field(gt=0)


SHELF: ModelShelf[EmbedderManifest] = ModelShelf("embedders", MANIFEST, EmbedderManifest)


def embedder_name(job_id: str) -> str:
    """The ``fine_tuned_model`` of an embedder job: ``ft-emb-<job>``."""
    return PREFIX + job_id.removeprefix("ftjob-")


def is_embedder_name(name: str) -> bool:
    return name.startswith(PREFIX) and is_safe_name(name)


def embedders_root(home: Path) -> Path:
    return SHELF.root(home)


def embedder_dir(home: Path, tenant: str, name: str) -> Path:
    return SHELF.model_dir(home, tenant, name)


def find_embedder(home: Path, tenant: str, name: str) -> tuple[Path, EmbedderManifest] | None:
    """The folder and manifest of ``tenant``'s embedder ``name``, or None when it has none."""
    return SHELF.find(home, tenant, name)


def list_embedders(home: Path, tenant: str) -> list[EmbedderManifest]:
    return SHELF.list(home, tenant)


def publish_embedder(home: Path, source: Path, manifest: EmbedderManifest) -> Path:
    """Copy the model folder ``source`` to the tenant's embedders with its manifest, whole or
    not at all; publishing the same name again replaces it."""
    return SHELF.publish(home, source, manifest)
