"""Server-side paths from API input: never trusted, always resolved inside allowed roots."""

from __future__ import annotations

import re
from pathlib import Path

from services.common.errors import InvalidRequest

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._ -]+")


def resolve_under_roots(
    value: str,
    roots: list[Path],
    *,
    param: str,
    setting: str = "TANDEM_MODEL_ROOTS",
    what: str = "model roots",
) -> Path:
    """Resolve ``value`` (symlinks and ``..`` included) and require it inside one of ``roots``
    (``setting`` names the setting that lists them, ``what`` says what they are for).

    A relative value is taken relative to the first root.
    """
    if not value or "\x00" in value:
        raise InvalidRequest(f"{param}: empty or invalid path {value!r}", param=param)
    if not roots:
        raise InvalidRequest(f"{param}: no allowed {what} are configured ({setting})", param=param)
    try:
        raw = Path(value).expanduser()
        candidate = (raw if raw.is_absolute() else roots[0] / raw).resolve()
    except (RuntimeError, ValueError, OSError) as exc:
        # "~nosuchuser/x" (no such home), a lone surrogate the file system can't encode, a
        # name too long: the client's value, so a 400 and not a 500.
        raise InvalidRequest(f"{param}: unusable path {value!r} ({exc})", param=param) from None
    for root in roots:
        if candidate == root.resolve() or candidate.is_relative_to(root.resolve()):
            return candidate
    allowed = ":".join(str(r) for r in roots)
    raise InvalidRequest(
        f"{param}: path {value!r} is outside the allowed roots ({allowed}); set {setting} to allow it",
        param=param,
    )


def safe_filename(name: str, *, param: str = "filename", max_len: int = 200) -> str:
    """A client-supplied file name reduced to a plain name that is safe to join to a folder."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    cleaned = _SAFE_NAME.sub("_", base).strip(" .")
    if not cleaned or cleaned in (".", ".."):
        raise InvalidRequest(f"{param}: unusable file name {name!r}", param=param)
    return cleaned[:max_len]
