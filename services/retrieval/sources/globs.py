"""Path globs that pick a source's files: ``docs/**/*.md``, ``README.md``, ``**``.

A glob matches a file's path within its source (``/``-separated, no leading ``/``), one
segment at a time: ``*`` and ``?`` stay within a segment, ``[abc]`` / ``[!abc]`` is one
character of a class, and a whole segment ``**`` spans any number of folders (none included),
so ``**/*.md`` matches ``README.md`` and ``docs/a/b.md``. A glob without ``/`` therefore
matches top-level files only, as a shell's does. Python 3.11's ``fnmatch`` lets ``*`` cross
``/``, and ``glob.translate`` arrived in 3.13: hence this small translator.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from services.common.errors import InvalidRequest

MAX_GLOB_CHARS = 256


def _bad(pattern: str, why: str, param: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: bad glob {pattern!r}: {why}", param=param, code="bad_glob")


def _segment(seg: str, pattern: str, param: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(seg):
        ch = seg[i]
        if ch == "*":
            while i + 1 < len(seg) and seg[i + 1] == "*":
                i += 1
            out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "[":
            end = seg.find("]", i + 2 if seg[i + 1 : i + 2] in ("!", "^") else i + 1)
            if end < 0:
                raise _bad(pattern, f"'[' at {i} has no closing ']'", param)
            body = seg[i + 1 : end]
            negate = body[:1] in ("!", "^")
            body = body[1:] if negate else body
            if not body:
                raise _bad(pattern, "an empty character class '[]'", param)
            escaped = "".join("\\" + c if c in "\\^[]" else c for c in body)
            out.append(f"[{'^/' if negate else ''}{escaped}]")
            i = end
        elif ch == "]":
            raise _bad(pattern, f"']' at {i} has no opening '['", param)
        else:
            out.append(re.escape(ch))
        i += 1
    return "".join(out)


def translate(pattern: str, param: str = "paths") -> str:
    """The regular expression of ``pattern``; InvalidRequest (naming it) for a bad glob."""
    if not pattern:
        raise _bad(pattern, "empty", param)
    if len(pattern) > MAX_GLOB_CHARS:
        raise _bad(pattern[:40] + "...", f"longer than {MAX_GLOB_CHARS} characters", param)
    if any(ord(c) < 32 for c in pattern) or "\\" in pattern:
        raise _bad(pattern, "control characters and '\\' are not allowed (separate folders with '/')", param)
    if pattern.startswith("/"):
        raise _bad(pattern, "it is relative to the source's root: drop the leading '/'", param)
    segments = pattern.split("/")
    if any(s in ("", ".", "..") for s in segments[:-1]) or segments[-1] in (".", ".."):
        raise _bad(pattern, "empty, '.' or '..' folder names are not allowed", param)
    if segments[-1] == "":
        segments[-1] = "**"  # "docs/" means everything under docs
    parts: list[str] = []
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        if seg == "**":
            parts.append(".+" if last else "(?:[^/]+/)*")
        else:
            parts.append(_segment(seg, pattern, param) + ("" if last else "/"))
    return "".join(parts)


def matcher(patterns: Sequence[str], param: str = "paths") -> Callable[[str], bool]:
    """Whether a path matches any of ``patterns`` (all paths when there are none)."""
    if not patterns:
        return lambda _path: True
    combined = re.compile("|".join(f"(?:{translate(p, f'{param}.{i}')})" for i, p in enumerate(patterns)))
    return lambda path: combined.fullmatch(path) is not None
