"""Metadata filters: a small Mongo-style language compiled to parameterised SQL.

    {"lang": "en"}                                   equality
    {"year": {"$gte": 2019, "$lt": 2024}}            ranges ($gt $gte $lt $lte)
    {"tag": {"$in": ["a", "b"]}}                     membership ($in, $nin)
    {"lang": {"$ne": "de"}}                          inequality
    {"$or": [{"lang": "en"}, {"year": 2020}]}        $and / $or of filters, $not of one
    several keys in one object are ANDed.

Values are strings, numbers, booleans or null. Anything else is rejected with a
message naming where in the filter the problem is.
"""

from __future__ import annotations

import math
from typing import Any

from services.common.errors import InvalidRequest

COMPARE = {"$eq": "=", "$ne": "!=", "$gt": ">", "$gte": ">=", "$lt": "<", "$lte": "<="}
SET_OPS = {"$in": "IN", "$nin": "NOT IN"}
LOGICAL = ("$and", "$or", "$not")
MAX_DEPTH = 16
# Bounds that keep one filter a cheap query (and under SQLite's 32766 bound parameters):
# conditions and $and/$or branches in the whole filter, and values in one $in / $nin list.
MAX_TERMS = 256
MAX_VALUES = 1024
INT64 = (-(2**63), 2**63 - 1)


def _bad(where: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"malformed filter at {where}: {why}", param="filters", code="invalid_filter")


def _scalar(value: Any, where: str) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
        raise _bad(where, f"integer {value} is outside the 64-bit range [{INT64[0]}, {INT64[1]}]")
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad(where, f"{value!r} is not a number (NaN and Infinity are refused)")
    if value is None or isinstance(value, str | bool | int | float):
        return value
    raise _bad(where, f"expected a string, number, boolean or null, got {type(value).__name__}")


def _field(key: str, where: str) -> str:
    if not key or key.startswith("$") or '"' in key or any(ord(c) < 32 for c in key):
        raise _bad(where, f"invalid field name {key!r}")
    return f'$."{key}"'


def _compare(path: str, op: str, value: Any, where: str, params: list[Any]) -> str:
    col = "json_extract(d.metadata, ?)"
    if op in COMPARE:
        v = _scalar(value, where)
        if v is None:
            if op not in ("$eq", "$ne"):
                raise _bad(where, f"{op} needs a value, got null")
            params.append(path)
            return f"{col} IS NULL" if op == "$eq" else f"{col} IS NOT NULL"
        if isinstance(v, bool):
            v = int(v)
        params.extend([path, v])
        return f"{col} {COMPARE[op]} ?"
    if op in SET_OPS:
        if not isinstance(value, list) or not value:
            raise _bad(where, f"{op} needs a non-empty list")
        if len(value) > MAX_VALUES:
            raise _bad(where, f"{op} has {len(value)} values; the limit is {MAX_VALUES}")
        vals = [int(x) if isinstance(x, bool) else x for x in (_scalar(x, where) for x in value)]
        params.append(path)
        params.extend(vals)
        return f"{col} {SET_OPS[op]} ({','.join('?' * len(vals))})"
    ops = ", ".join([*COMPARE, *SET_OPS])
    raise _bad(where, f"unknown operator {op!r} (use {ops})")


def _count(node: Any, where: str) -> None:
    """Refuse a filter with more than MAX_TERMS conditions before compiling any of it
    (iterative, so a deep filter cannot overflow the stack here either)."""
    terms = 0
    stack: list[tuple[Any, int]] = [(node, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _bad(where, f"nested deeper than {MAX_DEPTH} levels (the limit)")
        if isinstance(item, dict):
            for key, value in item.items():
                terms += 1
                if isinstance(value, list) and key in ("$and", "$or"):
                    stack.extend((v, depth + 1) for v in value)
                elif isinstance(value, dict):
                    stack.append((value, depth + 1))
        if terms > MAX_TERMS:
            raise _bad(where, f"more than {MAX_TERMS} conditions (the limit)")


def _compile(node: Any, where: str, params: list[Any], depth: int) -> str:
    if depth > MAX_DEPTH:
        raise _bad(where, f"nested deeper than {MAX_DEPTH}")
    if not isinstance(node, dict) or not node:
        raise _bad(where, "expected a non-empty object")
    parts: list[str] = []
    for key, value in node.items():
        here = f"{where}.{key}"
        if key in ("$and", "$or"):
            if not isinstance(value, list) or not value:
                raise _bad(here, f"{key} needs a non-empty list of filters")
            subs = [_compile(v, f"{here}[{i}]", params, depth + 1) for i, v in enumerate(value)]
            parts.append("(" + (" AND " if key == "$and" else " OR ").join(subs) + ")")
        elif key == "$not":
            parts.append(f"(NOT {_compile(value, here, params, depth + 1)})")
        elif key.startswith("$"):
            raise _bad(here, f"unknown operator {key!r} at this level (use $and, $or, $not or a field name)")
        else:
            path = _field(key, here)
            if isinstance(value, dict):
                if not value:
                    raise _bad(here, "empty condition object")
                for op, v in value.items():
                    parts.append(_compare(path, op, v, f"{here}.{op}", params))
            else:
                parts.append(_compare(path, "$eq", value, here, params))
    return "(" + " AND ".join(parts) + ")"


def compile_filter(filters: dict[str, Any]) -> tuple[str, list[Any]]:
    """SQL condition over ``d.metadata`` and its parameters."""
    params: list[Any] = []
    _count(filters, "filters")
    return _compile(filters, "filters", params, 0), params
