"""Readers: models that score whether a sentence answers a question, published per tenant.

The answer step of chat with documents asks a *reader* which candidate sentences answer the
question. The trainer's ``reader`` jobs train one (a sentence-transformers bi-encoder whose
cosines order the sentences, the default; or a ``CrossEncoder`` with one logit: the manifest's
``kind``) and publish its folder under ``$TANDEM_HOME/models/readers/<tenant>/<name>/`` with
the manifest ``tandem_reader.json``; an operator's job may publish it to the shared folder
``_shared`` instead, which every tenant resolves after its own. The inference service serves
a published reader through ``/v1/rerank`` by its name.

Training and serving score the same text: :func:`reader_passage` builds it from a sentence and
its section/heading context, so a client scoring candidates must build its documents with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from services.common.published_models import ModelShelf, PublishedManifest, is_safe_name

MANIFEST = "tandem_reader.json"
PREFIX = "ft-reader-"
SHARED = "_shared"


class ReaderManifest(PublishedManifest):
    """A published reader: name, owner folder (``_shared`` for a shared one), lineage, held-out
    figures (``auc_before``, ``auc``, ``mrr``, ...) and its decision threshold."""

    kind: Literal["cross-encoder", "bi-encoder"] = Field(
        "cross-encoder",
        description="how /v1/rerank scores with it: a cross-encoder's probability, or a bi-encoder's "
        "cosine of the query's and the document's vectors",
    )
    threshold: float | None = Field(
        None,
        description="the held-out score (the reader's sigmoid output, as /v1/rerank gives it) at or "
        "above which a sentence answers: the cut with the best F1 between answering and "
        "non-answering sentences; None when the held-out rows had only one label",
    )


SHELF: ModelShelf[ReaderManifest] = ModelShelf("readers", MANIFEST, ReaderManifest, shared=SHARED)


def reader_passage(sentence: str, context: str | None) -> str:
    """The text a reader scores against a question: the sentence's context (its section and
    headings) on the first line, then the sentence; the sentence alone without context."""
    return f"{context}\n{sentence}" if context else sentence


def reader_name(job_id: str) -> str:
    """The ``fine_tuned_model`` of a reader job: ``ft-reader-<job>``."""
    return PREFIX + job_id.removeprefix("ftjob-")


def is_reader_name(name: str) -> bool:
    return name.startswith(PREFIX) and is_safe_name(name)


def readers_root(home: Path) -> Path:
    return SHELF.root(home)


def reader_dir(home: Path, tenant: str, name: str) -> Path:
    return SHELF.model_dir(home, tenant, name)


def publish_reader(home: Path, source_dir: Path, manifest: ReaderManifest) -> Path:
    """Copy the reader folder ``source_dir`` under ``manifest.tenant`` (a tenant, or ``_shared``)
    with its manifest, whole or not at all; publishing the same name again replaces it."""
    return SHELF.publish(home, source_dir, manifest)


def find_reader(home: Path, tenant: str, name: str) -> tuple[Path, ReaderManifest] | None:
    """The folder and manifest of reader ``name`` as ``tenant`` resolves it: its own, else a
    shared one; None when neither has it (another tenant's readers are never found)."""
    return SHELF.find(home, tenant, name) or SHELF.find(home, SHARED, name)


def list_readers(home: Path, tenant: str) -> list[ReaderManifest]:
    """The readers ``tenant`` may use: its own, then the shared ones its own names do not hide."""
    own = SHELF.list(home, tenant)
    names = {m.name for m in own}
    shared = [] if tenant == SHARED else SHELF.list(home, SHARED)
    return own + [m for m in shared if m.name not in names]
