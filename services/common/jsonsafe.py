"""JSON that cannot hurt: a nesting-depth limit and no ``NaN`` / ``Infinity``.

Python's ``json`` accepts ``NaN`` and ``Infinity`` (not JSON) and recurses once per
nesting level, so a deeply nested document is a ``RecursionError`` (a 500, or a crashed
websocket handler) and a moderately nested one makes every later recursive walk (pydantic,
``json.dumps``, SQLite's JSON functions) slow or fragile. Every JSON input of the stack
(request bodies, websocket frames, JSONL files, form fields) goes through ``check`` or
``loads``; the walk is iterative, so it cannot itself overflow the stack.
"""

from __future__ import annotations

import json
import math
from typing import Any

from services.common.errors import InvalidRequest

MAX_DEPTH = 64

# A JSON object whose members belong to someone else's format, read member by member where it is
# used: a tool's arguments, a JSON schema, a provider's document, a token's claims. Things with
# a shape of Tandem's own get a model or a TypedDict instead.
JsonObject = dict[str, Any]


def _path(parts: tuple[str | int, ...], where: str) -> str:
    return ".".join([where, *(str(p) for p in parts)]) if parts else where


def find_problem(value: Any, *, max_depth: int = MAX_DEPTH) -> tuple[tuple[str | int, ...], str, str] | None:
    """(path, message, code) of the first problem in a parsed JSON value, or None."""
    top = _scalar_problem(value)
    if top is not None:
        return (), *top
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if len(path) > max_depth:
            return path, f"nested deeper than {max_depth} levels", "json_too_deep"
        if not isinstance(node, (dict, list)):
            continue
        # Paths are built for containers only: a body of millions of scalars (a list of token
        # ids) is one cheap loop, not millions of tuples, while the walk holds the GIL.
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(child, (dict, list)):
                stack.append((child, (*path, key)))
            elif isinstance(child, float):
                problem = _scalar_problem(child)
                if problem is not None:
                    return (*path, key), *problem
    return None


def _scalar_problem(node: Any) -> tuple[str, str] | None:
    if isinstance(node, float) and not math.isfinite(node):
        shown = "NaN" if math.isnan(node) else ("Infinity" if node > 0 else "-Infinity")
        return f"{shown} is not a JSON number (NaN and Infinity are refused)", "non_finite_number"
    return None


def check(value: Any, *, where: str = "body", max_depth: int = MAX_DEPTH) -> Any:
    """``value`` unchanged, or an InvalidRequest naming where it is too deep or not finite."""
    problem = find_problem(value, max_depth=max_depth)
    if problem is not None:
        path, message, code = problem
        name = _path(path[: max_depth + 1], where)
        raise InvalidRequest(f"{name}: {message}", param=name, code=code)
    return value


def loads(text: str | bytes, *, where: str = "body", max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` with the limits (a malformed document still raises ``json.JSONDecodeError``)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidRequest(
            f"{where}: nested deeper than {max_depth} levels", param=where, code="json_too_deep"
        ) from None
    return check(value, where=where, max_depth=max_depth)
