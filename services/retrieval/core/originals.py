"""The original file of a document whose text was parsed from a PDF, kept beside its collection
(``<collection>/originals/<hash of the document id>.pdf``) so that a reader can open a cited page
in the file itself (``GET /v1/collections/{name}/originals/{doc_id}``)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

FOLDER = "originals"


def original_path(root: Path, doc_id: str) -> Path:
    digest = hashlib.sha256(doc_id.encode("utf-8", "surrogatepass")).hexdigest()[:40]
    return root / FOLDER / f"{digest}.pdf"


def keep_original(root: Path, doc_id: str, src: Path) -> None:
    """Copy ``src`` as the original of ``doc_id`` (replacing an older one atomically)."""
    dst = original_path(root, doc_id)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def drop_original(root: Path, doc_id: str) -> None:
    original_path(root, doc_id).unlink(missing_ok=True)
