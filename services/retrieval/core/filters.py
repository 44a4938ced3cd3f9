"""Metadata filters: a small Mongo-style language parsed into a typed filter tree.

    {"lang": "en"}                                   equality
    {"year": {"$gte": 2019, "$lt": 2024}}            ranges ($gt $gte $lt $lte)
    {"tag": {"$in": ["a", "b"]}}                     membership ($in, $nin)
    {"lang": {"$ne": "de"}}                          inequality
    {"$or": [{"lang": "en"}, {"year": 2020}]}        $and / $or of filters, $not of one
    several keys in one object are ANDed.

Values are strings, numbers, booleans or null. Anything else is rejected with a
message naming where in the filter the problem is. The parsed ``Filter`` is what crosses
the ``DocumentStore`` protocol; each backend compiles it to its own query language
(``to_sql`` here for SQLite, ``services/retrieval/milvus/expr.py`` for Milvus).

Semantics (the same on every backend): a condition on a key a document's metadata does not
have is unknown, and unknown is never a match, negated or not (SQL's three-valued logic):
``{"lang": {"$ne": "de"}}`` and ``{"$not": {"lang": "de"}}`` skip documents without ``lang``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from services.common.errors import InvalidRequest

Scalar = str | int | float | bool | None
CompareOp = Literal["$eq", "$ne", "$gt", "$gte", "$lt", "$lte"]
SetOp = Literal["$in", "$nin"]

COMPARE = {"$eq": "=", "$ne": "!=", "$gt": ">", "$gte": ">=", "$lt": "<", "$lte": "<="}
SET_OPS = {"$in": "IN", "$nin": "NOT IN"}
LOGICAL = ("$and", "$or", "$not")
MAX_DEPTH = 16
# Bounds that keep one filter a cheap query (and under SQLite's 32766 bound parameters):
# conditions and $and/$or branches in the whole filter, and values in one $in / $nin list.
MAX_TERMS = 256
MAX_VALUES = 1024
INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class Compare:
    """``metadata[key] <op> value``; ``value`` None only with ``$eq``/``$ne`` (is / is not null)."""

    key: str
    op: CompareOp
    value: Scalar


@dataclass(frozen=True)
class InSet:
    key: str
    op: SetOp
    values: tuple[Scalar, ...]


@dataclass(frozen=True)
class AllOf:
    parts: tuple[Filter, ...]


@dataclass(frozen=True)
class AnyOf:
    parts: tuple[Filter, ...]


@dataclass(frozen=True)
class Not:
    part: Filter


Filter = Compare | InSet | AllOf | AnyOf | Not


def _bad(where: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"malformed filter at {where}: {why}", param="filters", code="invalid_filter")


def _scalar(value: Any, where: str) -> Scalar:
    if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
        raise _bad(where, f"integer {value} is outside the 64-bit range [{INT64[0]}, {INT64[1]}]")
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad(where, f"{value!r} is not a number (NaN and Infinity are refused)")
    if value is None or isinstance(value, str | bool | int | float):
        return value
    raise _bad(where, f"expected a string, number, boolean or null, got {type(value).__name__}")


def _key(key: str, where: str) -> str:
    if not key or key.startswith("$") or '"' in key or any(ord(c) < 32 for c in key):
        raise _bad(where, f"invalid field name {key!r}")
    return key


def _leaf(key: str, op: str, value: Any, where: str) -> Filter:
    if op in COMPARE:
        v = _scalar(value, where)
        if v is None and op not in ("$eq", "$ne"):
            raise _bad(where, f"{op} needs a value, got null")
        return Compare(key, op, v)  # type: ignore[arg-type]
    if op in SET_OPS:
        if not isinstance(value, list) or not value:
            raise _bad(where, f"{op} needs a non-empty list")
        if len(value) > MAX_VALUES:
            raise _bad(where, f"{op} has {len(value)} values; the limit is {MAX_VALUES}")
        return InSet(key, op, tuple(_scalar(x, where) for x in value))  # type: ignore[arg-type]
    ops = ", ".join([*COMPARE, *SET_OPS])
    raise _bad(where, f"unknown operator {op!r} (use {ops})")


def _count(node: Any, where: str) -> None:
    """Refuse a filter with more than MAX_TERMS conditions before parsing any of it
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


def _parse(node: Any, where: str, depth: int) -> Filter:
    if depth > MAX_DEPTH:
        raise _bad(where, f"nested deeper than {MAX_DEPTH}")
    if not isinstance(node, dict) or not node:
        raise _bad(where, "expected a non-empty object")
    parts: list[Filter] = []
    for key, value in node.items():
        here = f"{where}.{key}"
        if key in ("$and", "$or"):
            if not isinstance(value, list) or not value:
                raise _bad(here, f"{key} needs a non-empty list of filters")
            subs = tuple(_parse(v, f"{here}[{i}]", depth + 1) for i, v in enumerate(value))
            parts.append(AllOf(subs) if key == "$and" else AnyOf(subs))
        elif key == "$not":
            parts.append(Not(_parse(value, here, depth + 1)))
        elif key.startswith("$"):
            raise _bad(here, f"unknown operator {key!r} at this level (use $and, $or, $not or a field name)")
        else:
            name = _key(key, here)
            if isinstance(value, dict):
                if not value:
                    raise _bad(here, "empty condition object")
                parts.extend(_leaf(name, op, v, f"{here}.{op}") for op, v in value.items())
            else:
                parts.append(_leaf(name, "$eq", value, here))
    return parts[0] if len(parts) == 1 else AllOf(tuple(parts))


def parse_filter(filters: dict[str, Any]) -> Filter:
    """The typed filter of a request's ``filters`` (400 naming where it is malformed)."""
    _count(filters, "filters")
    return _parse(filters, "filters", 0)


# -- SQLite ---------------------------------------------------------------------------


def _sql_value(v: Scalar) -> str | int | float | None:
    # json_extract gives JSON true/false as 1/0
    return int(v) if isinstance(v, bool) else v


def _sql(node: Filter, params: list[Any]) -> str:
    if isinstance(node, AllOf | AnyOf):
        joiner = " AND " if isinstance(node, AllOf) else " OR "
        return "(" + joiner.join(_sql(p, params) for p in node.parts) + ")"
    if isinstance(node, Not):
        return f"(NOT {_sql(node.part, params)})"
    col = "json_extract(d.metadata, ?)"
    params.append(f'$."{node.key}"')
    if isinstance(node, InSet):
        params.extend(_sql_value(v) for v in node.values)
        return f"{col} {SET_OPS[node.op]} ({','.join('?' * len(node.values))})"
    if node.value is None:
        return f"{col} IS NULL" if node.op == "$eq" else f"{col} IS NOT NULL"
    params.append(_sql_value(node.value))
    return f"{col} {COMPARE[node.op]} ?"


def to_sql(node: Filter) -> tuple[str, list[Any]]:
    """SQL condition over ``d.metadata`` (documents aliased ``d``) and its parameters."""
    params: list[Any] = []
    return _sql(node, params), params
