"""The errors the parsers of core/formats_*.py raise: a file its library cannot read (a 400 that
names the file and the format, whatever the library raised: zip, XML, missing parts, bad
values...), and text past its limit."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from services.common.errors import InvalidRequest, TandemError
from services.retrieval.core.parsing import MIB, ParseLimits, _limit


def unreadable(filename: str, kind: str, why: str) -> InvalidRequest:
    return InvalidRequest(
        f"file {filename!r} is not a readable {kind}: {why}", param="file", code="corrupt_file"
    )


@contextmanager
def reading(filename: str, kind: str) -> Iterator[None]:
    """Turn whatever a parsing library raises into ``unreadable``; the service's own errors
    (limits, empty files) pass as they are, and so does running out of memory (the sandbox
    reports that as a limit)."""
    try:
        yield
    except (TandemError, MemoryError):
        raise
    except Exception as exc:
        raise unreadable(filename, kind, f"{type(exc).__name__}: {exc}") from None


def check_text_size(filename: str, size: int, limits: ParseLimits) -> None:
    """Stop a file whose text has grown past ``limits.max_text_bytes`` (characters so far)."""
    if size > limits.max_text_bytes:
        raise _limit(
            filename, f"more than {limits.max_text_bytes // MIB} MiB of text", "PARSE_MAX_DECOMPRESSED_MB"
        )
