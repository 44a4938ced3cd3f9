"""Folder sources: a folder on the server, under one of ``TANDEM_RETRIEVAL_SOURCE_ROOTS``.

The folder is resolved (links included) when the source is added and again at every sync, so
a folder later replaced by a link out of the allowed roots is refused then. Files are read in
place; links inside the folder are not followed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

from services.common.errors import InvalidRequest
from services.common.paths import resolve_under_roots
from services.retrieval.sources.fetched import Fetch, SourceError, walk_files
from services.retrieval.sources.git import ROOTS_SETTING


def folder_path(url: str, roots: list[Path]) -> Path:
    """The folder a folder source names (an absolute path or a ``file://`` URL), resolved and
    under the allowed roots; InvalidRequest naming the path otherwise."""
    path = url
    if url.lower().startswith("file:"):
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise InvalidRequest(f"url {url!r}: a file:// URL names no host", param="url")
        path = unquote(parts.path)
    if not path.startswith("/"):
        raise InvalidRequest(
            f"url {url!r}: a folder source is an absolute path on the server (or a file:// URL)",
            param="url",
            code="bad_url",
        )
    return resolve_under_roots(path, roots, param="url", setting=ROOTS_SETTING, what="source roots")


def fetch_folder(
    url: str, wanted: Callable[[str], bool], *, roots: list[Path], max_files: int, max_bytes: int
) -> Fetch:
    try:
        folder = folder_path(url, roots)
    except InvalidRequest as exc:
        raise SourceError(exc.message) from None
    if not folder.is_dir():
        raise SourceError(f"folder {str(folder)!r} does not exist (or is not a folder)")
    return walk_files(folder, wanted, max_files, max_bytes)
