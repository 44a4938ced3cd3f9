"""What a fetcher hands the sync: the source's files as they are now, on local disk.

A fetcher (git.py, web.py, folder.py) either returns a ``Fetch`` or raises ``SourceError``: the
source cannot be read now (a repository that is gone, a start page that answers 404, a folder
that is missing, an address the guard refuses). A ``SourceError`` fails the sync and leaves the
collection as it was; files missing from a ``Fetch`` leave the collection, except those in
``kept`` (not read this time for a reason that may pass, such as a page answering 503).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.retrieval.core.parsing import SUPPORTED, extension_of


class SourceError(Exception):
    """The source cannot be read now; the message says why (and names the URL or path)."""


@dataclass(frozen=True)
class FetchedFile:
    path: str  # within the source: a repository path, a folder path, a page's URL path
    local: Path  # its content, on disk
    name: str  # the file name the parser sees (its extension picks the format)
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Fetch:
    files: list[FetchedFile] = field(default_factory=list)
    kept: set[str] = field(default_factory=set)  # not read this time: their documents stay
    errors: list[dict[str, str]] = field(default_factory=list)  # {"path", "code", "message"}
    commit: str | None = None  # a git source: the commit synced


def file_error(path: str, code: str, message: str) -> dict[str, str]:
    return {"path": path, "code": code, "message": message}


def walk_files(
    root: Path, wanted: Callable[[str], bool], max_files: int, max_bytes: int, skip: tuple[str, ...] = ()
) -> Fetch:
    """The files under ``root`` whose path matches ``wanted`` and whose extension a parser
    reads. Links are not followed (a link in a repository or a folder could point anywhere
    on the server). A file over ``max_bytes`` is an error; past ``max_files`` files (in path
    order) the rest are left as they are in the collection (``kept``), with one error saying so."""
    found: list[tuple[str, Path]] = []
    for folder, dirs, names in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d not in skip)
        base = Path(folder)
        for name in names:
            local = base / name
            rel = local.relative_to(root).as_posix()
            if extension_of(name) not in SUPPORTED or not wanted(rel) or local.is_symlink():
                continue
            found.append((rel, local))
    found.sort()
    out = Fetch()
    out.kept.update(rel for rel, _ in found[max_files:])
    if len(found) > max_files:
        out.errors.append(
            file_error(
                "",
                "too_many_files",
                f"the source has {len(found)} files to sync; only the first {max_files} are read "
                "(TANDEM_RETRIEVAL_SOURCE_MAX_FILES)",
            )
        )
    for rel, local in found[:max_files]:
        size = local.stat().st_size
        if size > max_bytes:
            out.kept.add(rel)
            out.errors.append(
                file_error(
                    rel,
                    "file_too_large",
                    f"file {rel!r} ({size} bytes) is larger than {max_bytes >> 20} MiB "
                    "(TANDEM_RETRIEVAL_SOURCE_MAX_FILE_MB)",
                )
            )
            continue
        out.files.append(FetchedFile(rel, local, rel))
    return out
