"""Every field a client sends is bounded and strictly typed (docs/contracts.md, "Request limits").

The request models are found by walking each service's routes (body, query and header
parameters, and the models they nest), built as the fuzz tests build them, so a new route or
field is checked without being listed here: a string needs a ``max_length``, a list and a map a
``max_length`` (a map's keys and values bounded too), a number both a lower and an upper bound,
and a free-form JSON value a ``JsonBound``. A body's numbers and booleans are strict (a boolean is
not a number); a query string's are not (they arrive as text).
"""

from __future__ import annotations

import enum
import json
import tempfile
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import annotated_types
import httpx
import pytest
from fastapi import FastAPI, UploadFile
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute, APIWebSocketRoute, iter_route_contexts
from pydantic import BaseModel, Strict
from pydantic.fields import FieldInfo

from services.common.bounds import JsonBound
from services.common.config import CommonSettings
from tests.agent.stack import Stack, agent_stack, new_key
from tests.conftest import auth
from tests.helpers.servers import serve_app

# -- the services' apps, built and never started ------------------------------------------------


def _build(service: str, home: Path) -> FastAPI:
    common = CommonSettings(home=home, redis_url="redis://127.0.0.1:9/0", log_json=False)
    if service == "inference":
        from services.inference.app import create_app as inference_app
        from services.inference.config import InferenceSettings

        return inference_app(common, InferenceSettings(model="unloaded"))
    if service == "retrieval":
        from services.retrieval.app import create_app as retrieval_app
        from services.retrieval.config import RetrievalSettings

        return retrieval_app(common, RetrievalSettings(embedding_model="unloaded"))
    if service == "trainer":
        from services.trainer.app import create_app as trainer_app
        from services.trainer.config import TrainerSettings

        return trainer_app(common, TrainerSettings())
    from services.agent.app import create_app as agent_app
    from services.agent.config import AgentSettings

    return agent_app(common, AgentSettings())


SERVICES = ("inference", "retrieval", "trainer", "agent")


def _websocket_frames() -> dict[str, list[type[BaseModel]]]:
    """The models a websocket route reads its frames into (not visible as route parameters)."""
    from services.agent import protocol

    return {
        "/v1/ws/chat": [
            protocol.WsChatFrame,
            protocol.WsFeedbackFrame,
            protocol.WsRegenerateFrame,
            protocol.WsChooseFrame,
        ]
    }


# -- what a bounded field is ----------------------------------------------------------------------


def _metadata(field: FieldInfo | None, annotation: Any) -> tuple[Any, list[Any]]:
    """(the bare type, the constraints on it) of an annotation, ``Annotated`` unwrapped."""
    found: list[Any] = list(field.metadata) if field is not None else []
    while typing.get_origin(annotation) is typing.Annotated:
        annotation, *extra = typing.get_args(annotation)
        for item in extra:
            found.extend(item.metadata if isinstance(item, FieldInfo) else [item])
    return annotation, found


def _has(found: list[Any], *kinds: type) -> bool:
    return any(isinstance(m, kinds) for m in found)


def _max_length(found: list[Any]) -> bool:
    return any(getattr(m, "max_length", None) is not None for m in found)


def _strict(found: list[Any]) -> bool:
    return any(isinstance(m, Strict) and m.strict for m in found)


def _problems(
    annotation: Any, found: list[Any], where: str, *, body: bool, seen: set[type], strict: bool = False
) -> Iterator[str]:
    """Why the value at ``where`` is not bounded (nothing when it is); ``strict``: its model's
    config is strict, which (unlike a field's ``strict=True``) reaches list items and map values."""
    if strict:
        found = [*found, Strict()]
    if any(isinstance(m, JsonBound) for m in found):
        return
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for member in typing.get_args(annotation):
            inner, more = _metadata(None, member)
            yield from _problems(inner, found + more, where, body=body, seen=seen, strict=strict)
        return
    if annotation is type(None) or origin is typing.Literal:
        return
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return
    if annotation is bool:
        if body and not _strict(found):
            yield f"{where}: a boolean without strict=True (1 or 'true' would be read as true)"
        return
    if annotation in (int, float):
        if not (_has(found, annotated_types.Ge, annotated_types.Gt)):
            yield f"{where}: a number without a lower bound (ge/gt)"
        if not (_has(found, annotated_types.Le, annotated_types.Lt)):
            yield f"{where}: a number without an upper bound (le/lt)"
        if body and not _strict(found):
            yield f"{where}: a number without strict=True (true would be read as 1)"
        return
    if annotation in (str, bytes):
        if not _max_length(found):
            yield f"{where}: a string without max_length"
        return
    if isinstance(annotation, type) and issubclass(annotation, UploadFile):
        return  # its size is the route's body limit
    if origin in (list, set, frozenset, tuple, typing.Sequence) or annotation in (list, set, tuple):
        if not _max_length(found):
            yield f"{where}: a list without max_length"
        for item in typing.get_args(annotation):
            if item is not Ellipsis:
                inner, more = _metadata(None, item)
                yield from _problems(inner, more, f"{where}[]", body=body, seen=seen, strict=strict)
        return
    if origin is dict or annotation is dict:
        if not _max_length(found):
            yield f"{where}: a map without max_length (a number of pairs)"
        args = typing.get_args(annotation) or (Any, Any)
        for part, item in zip(("key", "value"), args, strict=True):
            inner, more = _metadata(None, item)
            yield from _problems(inner, more, f"{where}.<{part}>", body=body, seen=seen, strict=strict)
        return
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield from _model_problems(annotation, body=body, seen=seen)
        return
    if annotation is Any:
        yield f"{where}: any JSON value without a JsonBound"
        return
    yield f"{where}: {annotation!r} is not a type this test knows how to bound"


def _model_problems(model: type[BaseModel], *, body: bool, seen: set[type]) -> Iterator[str]:
    if model in seen:
        return
    seen.add(model)
    strict = bool(model.model_config.get("strict"))
    for name, field in model.model_fields.items():
        annotation, found = _metadata(field, field.annotation)
        where = f"{model.__name__}.{name}"
        yield from _problems(annotation, found, where, body=body, seen=seen, strict=strict)


def _dependants(dependant: Dependant) -> Iterator[Dependant]:
    yield dependant
    for sub in dependant.dependencies:
        yield from _dependants(sub)


def _route_problems(app: FastAPI) -> Iterator[str]:
    seen: set[type] = set()
    frames = _websocket_frames()
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        if isinstance(route, APIWebSocketRoute):
            for model in frames.get(str(context.path), []):
                yield from _model_problems(model, body=True, seen=seen)
            continue
        if not isinstance(route, APIRoute):
            continue
        for dependant in _dependants(route.dependant):
            for param in dependant.body_params:
                annotation, found = _metadata(param.field_info, param.field_info.annotation)
                where = f"{context.path} body {param.name}"
                form = type(param.field_info).__name__ in ("Form", "File")
                yield from _problems(annotation, found, where, body=not form, seen=seen)
            for param in [*dependant.query_params, *dependant.header_params, *dependant.cookie_params]:
                annotation, found = _metadata(param.field_info, param.field_info.annotation)
                where = f"{context.path} query {param.name}"
                yield from _problems(annotation, found, where, body=False, seen=seen)


@pytest.fixture(scope="module")
def apps() -> Iterator[dict[str, FastAPI]]:
    with tempfile.TemporaryDirectory() as home:
        yield {service: _build(service, Path(home) / service) for service in SERVICES}


@pytest.mark.parametrize("service", SERVICES)
def test_every_request_field_is_bounded(apps: dict[str, FastAPI], service: str) -> None:
    problems = sorted(set(_route_problems(apps[service])))
    assert not problems, "unbounded request fields:\n" + "\n".join(problems)


def test_the_walk_finds_an_unbounded_field() -> None:
    """The check itself: a model with each kind of unbounded field is caught, field by field."""

    class Inner(BaseModel):
        note: str

    class Loose(BaseModel):
        name: str
        count: int = 0
        ids: list[int] = []
        tags: dict[str, str] = {}
        anything: Any = None
        flag: bool = False
        inner: Inner | None = None

    found = " ".join(_model_problems(Loose, body=True, seen=set()))
    for where in ("Loose.name", "Loose.count", "Loose.ids", "Loose.tags", "Loose.anything", "Loose.flag"):
        assert where in found
    assert "Inner.note" in found


# -- the probes: each refused with a 400 naming the field and its limit ---------------------------


def _served(service: str, home: Path, redis_url: str, model: Path | None = None) -> Any:
    common = CommonSettings(home=home, redis_url=redis_url, log_json=False)
    if service == "inference":
        from services.inference.app import create_app as inference_app
        from services.inference.config import InferenceSettings

        settings = InferenceSettings(model=str(model), served_model_name="tiny", max_model_len=128)
        return inference_app(common, settings)
    from services.retrieval.app import create_app as retrieval_app
    from services.retrieval.config import RetrievalSettings

    return retrieval_app(common, RetrievalSettings(embedding_model="unloaded", tenant_requests_per_minute=0))


@pytest.fixture(scope="module")
def key(redis_url: str) -> str:
    return new_key(redis_url, "bounds")


@pytest.fixture(scope="module")
def inference_url(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, tiny_model_path: Path
) -> Iterator[str]:
    home = tmp_path_factory.mktemp("bounds-inference")
    with serve_app(_served("inference", home, redis_url, tiny_model_path)) as url:
        yield url


@pytest.fixture(scope="module")
def retrieval_url(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[str]:
    with serve_app(_served("retrieval", tmp_path_factory.mktemp("bounds-retrieval"), redis_url)) as url:
        yield url


@pytest.fixture(scope="module")
def agent(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with agent_stack(redis_url, tmp_path_factory.mktemp("bounds-agent")) as stack:
        yield stack


def _refused(response: httpx.Response, param: str, *words: str, status: int = 400) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    # the field, or a place inside it (``metadata.k``, ``logit_bias.5``, a union's member)
    assert error["param"] == param or error["param"].startswith(param + "."), error
    for word in words:
        assert word in error["message"], error
    return str(error["message"])


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}


def test_six_million_stop_token_ids_are_refused_before_any_work(inference_url: str, key: str) -> None:
    # 12 MB of ids: under the 16 MiB body limit, so the field's own bound is what refuses them
    body = json.dumps({**CHAT, "stop_token_ids": [7] * 6_000_000}, separators=(",", ":"))
    assert 12_000_000 < len(body) < 16 << 20
    response = httpx.post(
        f"{inference_url}/v1/chat/completions",
        content=body,
        headers={**auth(key), "Content-Type": "application/json"},
        timeout=120,
    )
    _refused(response, "stop_token_ids", "at most 64")


@pytest.mark.parametrize(
    ("route", "field", "value", "limit"),
    [
        ("/v1/chat/completions", "n", 1000, "16"),
        ("/v1/completions", "best_of", 1000, "16"),
        ("/v1/chat/completions", "logit_bias", {str(i): 1 for i in range(1000)}, "300"),
        ("/v1/chat/completions", "logit_bias", {"5": 1000}, "100"),
        ("/v1/chat/completions", "top_logprobs", 21, "20"),
        ("/v1/completions", "logprobs", 21, "20"),
        ("/v1/chat/completions", "stop", ["x"] * 17, "16"),
        ("/v1/chat/completions", "stop", "x" * 257, "256"),
        ("/v1/chat/completions", "max_tokens", 1 << 30, str(1 << 20)),
        ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}] * 129, "128"),
    ],
)
def test_sampling_fields_are_bounded(
    inference_url: str, key: str, route: str, field: str, value: Any, limit: str
) -> None:
    base = CHAT if route == "/v1/chat/completions" else {"model": "tiny", "prompt": "Hi"}
    response = httpx.post(f"{inference_url}{route}", json={**base, field: value}, headers=auth(key))
    _refused(response, field, limit)


def test_min_tokens_above_max_tokens_is_refused(inference_url: str, key: str) -> None:
    response = httpx.post(
        f"{inference_url}/v1/chat/completions",
        json={**CHAT, "max_tokens": 8, "min_tokens": 9},
        headers=auth(key),
    )
    _refused(response, "min_tokens", "max_tokens (8)")
    response = httpx.post(
        f"{inference_url}/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "min_tokens": 17},
        headers=auth(key),
    )
    _refused(response, "min_tokens", "max_tokens (16)")


@pytest.mark.parametrize(("field", "value"), [("temperature", True), ("n", True), ("stream", 1), ("n", 2.0)])
def test_a_boolean_is_not_a_number_nor_a_number_a_boolean(
    inference_url: str, key: str, field: str, value: Any
) -> None:
    response = httpx.post(
        f"{inference_url}/v1/chat/completions", json={**CHAT, field: value}, headers=auth(key)
    )
    _refused(response, field)


def test_an_integer_is_still_a_float(inference_url: str, key: str) -> None:
    response = httpx.post(
        f"{inference_url}/v1/chat/completions",
        json={**CHAT, "temperature": 1, "top_p": 1, "max_tokens": 1},
        headers=auth(key),
        timeout=60,
    )
    assert response.status_code == 200, response.text


RESPONSES_PROBES = [
    ("metadata", {f"k{i}": "v" for i in range(17)}, "16"),
    ("metadata", {"k" * 65: "v"}, "64"),
    ("metadata", {"k": "v" * 513}, "512"),
    ("input", [{"role": "user", "content": "Hi"}] * 10_000, "2048"),
    ("tools", [{"type": "function", "name": "f"}] * 129, "128"),
    ("max_output_tokens", 1e9, "integer"),
]


@pytest.mark.parametrize(("field", "value", "limit"), RESPONSES_PROBES)
def test_inference_responses_fields_are_bounded(
    inference_url: str, key: str, field: str, value: Any, limit: str
) -> None:
    response = httpx.post(
        f"{inference_url}/v1/responses",
        json={"model": "tiny", "input": "Hi", field: value},
        headers=auth(key),
    )
    message = _refused(response, field.split(".")[0], limit)
    assert "metadata" not in message or field == "metadata"


@pytest.mark.parametrize(("field", "value", "limit"), RESPONSES_PROBES)
def test_agent_responses_fields_are_bounded(
    agent: Stack, key: str, field: str, value: Any, limit: str
) -> None:
    response = httpx.post(
        f"{agent.url}/v1/responses",
        json={"model": "chat-documents", "input": "Hi", field: value},
        headers=auth(key),
        timeout=60,
    )
    _refused(response, field, limit)


def test_the_agent_refuses_answer_tokens_beyond_the_context_window(agent: Stack, key: str) -> None:
    """Under the static ceiling, over the model's window (context_tokens, 2048 by default)."""
    response = httpx.post(
        f"{agent.url}/v1/responses",
        json={"model": "chat-documents", "input": "Hi", "max_output_tokens": 100_000},
        headers=auth(key),
        timeout=60,
    )
    _refused(response, "max_output_tokens", "context window of 2048")
    response = httpx.post(
        f"{agent.url}/v1/chat/completions",
        json={"model": "chat-documents", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4096},
        headers=auth(key),
        timeout=60,
    )
    _refused(response, "max_tokens", "context window of 2048")


def test_canary_share_true_is_not_a_share(agent: Stack, key: str) -> None:
    response = httpx.post(
        f"{agent.url}/v1/models/ft-x/promote", json={"canary_share": True}, headers=auth(key)
    )
    _refused(response, "canary_share", "number")
    response = httpx.post(f"{agent.url}/v1/models/ft-x/promote", json={"canary_share": 2}, headers=auth(key))
    _refused(response, "canary_share", "1")


@pytest.mark.parametrize("route", ["/v1/quality", "/v1/quality/worst", "/v1/feedback"])
@pytest.mark.parametrize("since", ["inf", "1e400", "nan", "-1", "1e11"])
def test_since_must_be_a_finite_time_before_2100(agent: Stack, key: str, route: str, since: str) -> None:
    response = httpx.get(f"{agent.url}{route}", params={"since": since}, headers=auth(key))
    _refused(response, "since")


def test_since_in_range_is_answered(agent: Stack, key: str) -> None:
    response = httpx.get(f"{agent.url}/v1/quality", params={"since": "0"}, headers=auth(key))
    assert response.status_code == 200, response.text


def test_chunking_overlap_false_is_not_zero(retrieval_url: str, key: str) -> None:
    response = httpx.post(
        f"{retrieval_url}/v1/collections",
        json={"name": "kb", "chunking": {"size": 64, "overlap": False}},
        headers=auth(key),
    )
    _refused(response, "chunking.overlap", "integer")


def test_document_metadata_is_bounded(retrieval_url: str, key: str) -> None:
    documents = [{"id": "d", "text": "t", "metadata": {f"k{i}": i for i in range(1001)}}]
    response = httpx.post(
        f"{retrieval_url}/v1/collections/kb/documents", json={"documents": documents}, headers=auth(key)
    )
    _refused(response, "documents.0.metadata", "1000 values")


def test_json_bound_counts_nested_values_and_long_keys() -> None:
    bound = JsonBound(values=4, chars=3)
    assert bound.check({"a": [1, 2], "b": "xyz"}) == {"a": [1, 2], "b": "xyz"}
    with pytest.raises(ValueError, match="more than 4 values"):
        bound.check({"a": [1, 2, [3]]})
    with pytest.raises(ValueError, match="longer than 3"):
        bound.check({"long": 1})
