"""Metadata filters (``core/filters.py``) as Milvus boolean expressions over the chunks'
``metadata`` JSON field.

Milvus Lite has no ``not`` and no test for a missing JSON key, so negations are pushed down
to the leaves (De Morgan; ``$gt`` becomes ``$lte`` and so on), and ``$ne``/``$nin`` carry a
guard that the key holds a string, number or boolean: Milvus alone would match documents
without the key, where the embedded backend (SQL) calls the comparison unknown and skips them.
"""

from __future__ import annotations

import json

from services.common.errors import InvalidRequest
from services.retrieval.core.filters import AllOf, AnyOf, Compare, Filter, InSet, Not, Scalar

FLIP = {"$eq": "$ne", "$ne": "$eq", "$gt": "$lte", "$lte": "$gt", "$gte": "$lt", "$lt": "$gte"}
OPS = {"$eq": "==", "$ne": "!=", "$gt": ">", "$gte": ">=", "$lt": "<", "$lte": "<="}


def _unsupported(why: str) -> InvalidRequest:
    return InvalidRequest(f"filters: {why} on the milvus backend", param="filters", code="invalid_filter")


def string_literal(s: str) -> str:
    """A Milvus string literal. Milvus does not unescape \\n or \\u sequences, and refuses a raw
    control character, so strings holding one cannot be compared."""
    if any(ord(c) < 32 for c in s):
        raise _unsupported(f"the string {s!r} holds a control character, which Milvus cannot compare")
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _value(v: Scalar) -> str:
    if v is None:
        raise _unsupported("null comparisons are not supported")
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return string_literal(v)
    return json.dumps(v)


def _field(key: str) -> str:
    return f"metadata[{string_literal(key)}]"


def _has(field: str) -> str:
    # Any string, number or boolean (no 'exists' in Milvus Lite): what SQL's NULL rules need.
    return f'({field} >= "" or {field} >= -1.0e308 or {field} in [true, false])'


def _negate(node: Filter) -> Filter:
    if isinstance(node, Compare):
        return Compare(node.key, FLIP[node.op], node.value)  # type: ignore[arg-type]
    if isinstance(node, InSet):
        return InSet(node.key, "$nin" if node.op == "$in" else "$in", node.values)
    if isinstance(node, AllOf):
        return AnyOf(tuple(_negate(p) for p in node.parts))
    if isinstance(node, AnyOf):
        return AllOf(tuple(_negate(p) for p in node.parts))
    return node.part


def to_expr(node: Filter) -> str:
    """The Milvus expression of ``node`` (400 for what Milvus cannot express)."""
    if isinstance(node, Not):
        return to_expr(_negate(node.part))
    if isinstance(node, AllOf | AnyOf):
        joiner = " and " if isinstance(node, AllOf) else " or "
        return "(" + joiner.join(to_expr(p) for p in node.parts) + ")"
    field = _field(node.key)
    if isinstance(node, InSet):
        values = "[" + ", ".join(_value(v) for v in node.values) + "]"
        if node.op == "$in":
            return f"({field} in {values})"
        return f"({field} not in {values} and {_has(field)})"
    expr = f"{field} {OPS[node.op]} {_value(node.value)}"
    return f"({expr} and {_has(field)})" if node.op == "$ne" else f"({expr})"
