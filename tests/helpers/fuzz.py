"""Schemathesis for the fuzz tests (tests/test_fuzz.py): a service's OpenAPI schema, the
generation settings (a fixed seed, derandomized, a bounded number of examples) and the
checks every response must pass."""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import schemathesis
from fastapi import FastAPI
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.specs.openapi.schemas import OpenApiSchema

from services.common.config import CommonSettings
from tests.helpers.waiting import wait_until

# No 5xx; the status code is one the operation declares; the Content-Type and the body match
# what the schema declares for that status.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# A run is repeatable: this seed, derandomized. To look further than the suite does, run
# with FUZZ_EXAMPLES=100 FUZZ_SEED=<any> (and keep what it finds in tests/test_fuzz_found.py).
SEED = 20261130


@schemathesis.serializer("application/jsonl")
def _json_lines(ctx: schemathesis.SerializationContext, value: Any) -> bytes:
    """JSON-lines bodies (question-set uploads) are text: the generated string as it is, or one
    line of JSON for whatever else the fuzzer makes of the schema."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text.encode("utf-8", "surrogatepass")


def fuzz_schema(
    build: Callable[[CommonSettings], FastAPI],
    *,
    max_examples: int,
    values: dict[str, list[str | int]] | None = None,
) -> OpenApiSchema:
    """The OpenAPI schema of the app ``build`` makes, read at import time (pytest parametrizes
    one test per operation from it) from an app that is built and never started: a temporary
    home and an unreachable Redis (clients connect lazily). The test serves another app built
    the same way with real settings, and checks that it serves this same schema.

    ``values``: request fields (``body.model``, ``path.name``, ...) -> real values (a served
    model, an existing collection) that generation uses half of the time, so that requests
    get past "not found" to the code behind it."""
    with tempfile.TemporaryDirectory() as home:
        app = build(CommonSettings(home=Path(home), redis_url="redis://127.0.0.1:9/0", log_json=False))
        document = app.openapi()
    values = values or {}
    config = SchemathesisConfig.from_dict(
        {
            "seed": int(os.environ.get("FUZZ_SEED", SEED)),
            "generation": {
                "deterministic": True,
                "max-examples": int(os.environ.get("FUZZ_EXAMPLES", max_examples)),
                "database": "none",
            },
            "phases": {"stateful": {"enabled": False}},
            "dictionaries": {field.replace(".", "-"): {"values": v} for field, v in values.items()},
            "parameters": {
                field: {"dictionary": field.replace(".", "-"), "probability": 0.5} for field in values
            },
        }
    )
    return schemathesis.openapi.from_dict(document, config=config)


def check(case: Any, base_url: str, key: str, **kwargs: Any) -> Any:
    """Send the case with the key and assert every check of CHECKS."""
    response = case.call(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60, **kwargs)
    case.validate_response(response, checks=CHECKS)
    return response


_turn = itertools.count()


def use_real_values(case: Any, *, path: dict[str, str], body: dict[str, str]) -> None:
    """Every other case, put values that exist only at run time (ids the fixture made) in
    the fields of the case that have them: the other half keeps what was generated."""
    if next(_turn) % 2:
        return
    for name, value in path.items():
        if case.path_parameters and name in case.path_parameters:
            case.path_parameters[name] = value
    if isinstance(case.body, dict):
        for name, value in body.items():
            if name in case.body:
                case.body[name] = value


def wait_ready(url: str, key: str, schema: OpenApiSchema, timeout: float = 120) -> None:
    """Wait for /readyz (a 503 before then is the truth, not what the fuzzer tests), and check
    that the served schema is the one the tests were generated from."""
    headers = {"Authorization": f"Bearer {key}"}
    wait_until(
        lambda: httpx.get(f"{url}/readyz", headers=headers, timeout=30).status_code == 200,
        timeout,
        f"{url}/readyz to answer 200",
        interval=0.2,
    )
    served = httpx.get(f"{url}/openapi.json", headers=headers, timeout=30)
    assert served.status_code == 200, served.text
    assert served.json()["paths"] == schema.raw_schema["paths"]
