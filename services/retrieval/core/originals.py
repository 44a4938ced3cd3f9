"""The original file of a document whose text was parsed from a PDF or read by OCR from an image,
kept beside its collection (``<collection>/originals/<hash of the document id><ext>``) so that a
reader can open a cited page in the file itself (``GET /v1/collections/{name}/originals/{doc_id}``).

Browsers show PDFs (through pdf.js), PNG and JPEG, but not TIFF: a TIFF's frame is served as a
PNG made on first request (core/renditions.py) and kept beside the original
(``<hash>.p<page>.png``) until the document goes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

FOLDER = "originals"

# What is kept, by extension, and the media type it is served as.
MEDIA_TYPES = {
    ".pdf": "application/pdf",
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".tif": "image/tiff",
    ".tiff": "image/tiff",
}
KEPT = tuple(MEDIA_TYPES)


def _digest(doc_id: str) -> str:
    return hashlib.sha256(doc_id.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def original_path(root: Path, doc_id: str, ext: str = ".pdf") -> Path:
    return root / FOLDER / f"{_digest(doc_id)}{ext}"


def find_original(root: Path, doc_id: str) -> Path | None:
    """The kept original of ``doc_id`` (whichever type it is), or None."""
    for ext in KEPT:
        path = original_path(root, doc_id, ext)
        if path.is_file():
            return path
    return None


def rendition_path(original: Path, page: int) -> Path:
    """Where the PNG of ``page`` of a TIFF original is kept."""
    return original.with_name(f"{original.stem}.p{page}.png")


def keep_original(root: Path, doc_id: str, src: Path, ext: str = ".pdf") -> None:
    """Copy ``src`` as the original of ``doc_id`` (replacing an older one, of any type, atomically)."""
    dst = original_path(root, doc_id, ext)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".tmp")
    shutil.copyfile(src, tmp)
    drop_original(root, doc_id)
    os.replace(tmp, dst)


def drop_original(root: Path, doc_id: str) -> None:
    """The original of ``doc_id`` and the PNGs made of its pages, gone."""
    folder = root / FOLDER
    if not folder.is_dir():
        return
    digest = _digest(doc_id)
    for path in folder.glob(f"{digest}.*"):
        # "<digest>.tmp" is a copy keep_original is about to move in place
        if path.name != f"{digest}.tmp":
            path.unlink(missing_ok=True)
