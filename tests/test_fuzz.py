"""Property-based API tests of every service from its own OpenAPI schema (Schemathesis).

Each service runs over real HTTP with a real Valkey and tiny models, and is sent generated
requests, valid and invalid, for every operation its schema lists (one test per operation):
no response may be a 5xx, and each must be a status the operation declares, with the
declared Content-Type and a body that matches the declared schema (the one error shape for
errors). Generation is derandomized with a fixed seed and a bounded number of examples, so
a run is repeatable and the module stays within a few minutes on two cores. What the fuzzer
found is kept as plain regression tests in tests/test_fuzz_found.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from services.common.auth import KeyStore
from services.common.config import CommonSettings
from tests.helpers.fuzz import check, fuzz_schema, use_real_values, wait_ready
from tests.helpers.servers import serve_app


@pytest.fixture(scope="module")
def operator_key(redis_url: str) -> str:
    """An operator key: the fuzzer reaches the validation of operator routes too (a tenant
    key gets a 403 there before any field is read)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return KeyStore(client).create("acme", operator=True)[0]
    finally:
        client.close()


def _common(home: Path, redis_url: str, **extra: Any) -> CommonSettings:
    return CommonSettings(home=home, redis_url=redis_url, log_json=False, **extra)


# -- inference ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_embedder() -> Path:
    """The retrieval tests' 1-layer random sentence-transformer (built once, cached)."""
    from tests.conftest import TEST_CACHE
    from tests.retrieval.conftest import make_tiny_embedder

    root = TEST_CACHE / "retrieval-models"
    root.mkdir(parents=True, exist_ok=True)
    return make_tiny_embedder(root / "tiny-embedder")


def _inference_app(common: CommonSettings, model: str = "unloaded", embedder: str = "unloaded") -> Any:
    from services.inference.app import create_app
    from services.inference.config import InferenceSettings

    settings = InferenceSettings(
        model=model,
        served_model_name="tiny",
        max_model_len=128,
        max_batch_size=4,
        max_queue=16,
        embedding_models=f"mini={embedder}",
    )
    return create_app(common, settings)


INFERENCE = fuzz_schema(
    _inference_app,
    max_examples=15,
    values={"body.model": ["tiny", "mini"], "path.model_id": ["tiny"], "path.model": ["mini"]},
)


@pytest.fixture(scope="module")
def inference_url(
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
    tiny_model_path: Path,
    tiny_embedder: Path,
    operator_key: str,
) -> Iterator[str]:
    """The tiny chat model as ``tiny`` and the tiny embedder as ``mini`` (no rerank model: the
    rerank routes' validation and their 404 are what is fuzzed there)."""
    common = _common(
        tmp_path_factory.mktemp("fuzz-inference"), redis_url, model_roots=str(tiny_embedder.parent)
    )
    app = _inference_app(common, str(tiny_model_path), str(tiny_embedder))
    with serve_app(app) as url:
        wait_ready(url, operator_key, INFERENCE)
        yield url


@INFERENCE.parametrize()
def test_inference(case: Any, inference_url: str, operator_key: str) -> None:
    check(case, inference_url, operator_key)


# -- retrieval ---------------------------------------------------------------------------------


def _retrieval_app(common: CommonSettings, embedder: str = "unloaded") -> Any:
    from services.retrieval.app import create_app
    from services.retrieval.config import RetrievalSettings

    # No per-tenant rate: the fuzzer's hundreds of requests a minute are not what it tests.
    return create_app(common, RetrievalSettings(embedding_model=embedder, tenant_requests_per_minute=0))


RETRIEVAL = fuzz_schema(
    _retrieval_app,
    max_examples=15,
    values={"path.name": ["kb"], "path.doc_id": ["cats"], "body.name": ["kb"]},
)


@pytest.fixture(scope="module")
def retrieval_url(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, tiny_embedder: Path, operator_key: str
) -> Iterator[str]:
    """The service with the tiny embedder and a collection ``kb`` holding two documents."""
    common = _common(
        tmp_path_factory.mktemp("fuzz-retrieval"), redis_url, model_roots=str(tiny_embedder.parent)
    )
    with serve_app(_retrieval_app(common, str(tiny_embedder))) as url:
        wait_ready(url, operator_key, RETRIEVAL)
        _seed_kb(url, operator_key)
        yield url


def _seed_kb(url: str, key: str) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    made = httpx.post(f"{url}/v1/collections", json={"name": "kb"}, headers=headers)
    assert made.status_code in (201, 409), made.text
    docs = [
        {"id": "cats", "text": "Cats purr and chase mice.", "metadata": {"year": 2020}},
        {"id": "dogs", "text": "Dogs bark at the mail carrier.", "metadata": {"year": 2018}},
    ]
    added = httpx.post(f"{url}/v1/collections/kb/documents", json={"documents": docs}, headers=headers)
    assert added.status_code == 201, added.text


@RETRIEVAL.parametrize()
def test_retrieval(case: Any, retrieval_url: str, operator_key: str) -> None:
    check(case, retrieval_url, operator_key)
    if case.method == "DELETE":
        # The fuzzer deletes kb or its documents now and then: put them back for the next cases.
        _seed_kb(retrieval_url, operator_key)


# -- trainer -----------------------------------------------------------------------------------


def _trainer_app(common: CommonSettings) -> Any:
    from services.trainer.app import create_app
    from services.trainer.config import TrainerSettings

    return create_app(common, TrainerSettings(tenant_requests_per_minute=0))


@pytest.fixture(scope="module")
def trainer_ids(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, tiny_model_path: Path, operator_key: str
) -> Iterator[tuple[str, str, str]]:
    """(URL, a dataset's file id, a queued job's id). Jobs are queued, never run: job launch
    (torch) is the end-to-end tests' business; what is fuzzed here is everything up to it."""
    common = _common(
        tmp_path_factory.mktemp("fuzz-trainer"), redis_url, model_roots=str(tiny_model_path.parent)
    )
    app = _trainer_app(common)
    app.state.trainer.dispatch = lambda job_id, queue: None
    with serve_app(app) as url:
        wait_ready(url, operator_key, TRAINER)
        headers = {"Authorization": f"Bearer {operator_key}"}
        rows = [
            {
                "messages": [
                    {"role": "user", "content": f"Count to {n}."},
                    {"role": "assistant", "content": "1 2"},
                ]
            }
            for n in range(4)
        ]
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
        up = httpx.post(
            f"{url}/v1/files",
            files={"file": ("train.jsonl", data)},
            data={"purpose": "fine-tune"},
            headers=headers,
        )
        assert up.status_code == 201, up.text
        file_id = up.json()["id"]
        spec = {"type": "sft", "base_model": str(tiny_model_path), "dataset": file_id}
        job = httpx.post(f"{url}/v1/jobs", json=spec, headers=headers)
        assert job.status_code == 201, job.text
        yield url, file_id, job.json()["id"]


TRAINER = fuzz_schema(_trainer_app, max_examples=15)


@TRAINER.parametrize()
def test_trainer(case: Any, trainer_ids: tuple[str, str, str], operator_key: str) -> None:
    url, file_id, job_id = trainer_ids
    # Real ids half of the time: they exist only once the fixture ran, after collection.
    use_real_values(case, path={"file_id": file_id, "job_id": job_id}, body={"dataset": file_id})
    check(case, url, operator_key)


# -- agent -------------------------------------------------------------------------------------


def _agent_app(common: CommonSettings) -> Any:
    from services.agent.app import create_app
    from services.agent.config import AgentSettings

    return create_app(common, AgentSettings(tenant_requests_per_minute=0))


AGENT = fuzz_schema(
    _agent_app,
    max_examples=15,
    values={"path.name": ["chat-documents", "semantic-search"], "body.collection": ["geo"]},
)


@pytest.fixture(scope="module")
def agent_ids(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, operator_key: str
) -> Iterator[tuple[str, str, str]]:
    """(URL, a remembered answer's message id, its conversation id): the agent over real HTTP
    with doubles of retrieval, inference and trainer (their real versions are fuzzed above)."""
    from tests.agent.stack import agent_stack

    with agent_stack(redis_url, tmp_path_factory.mktemp("fuzz-agent"), tenant_requests_per_minute=0) as stack:
        wait_ready(stack.url, operator_key, AGENT)
        answer = httpx.post(
            f"{stack.url}/v1/pipelines/chat-documents/run",
            json={"query": "What is the capital of France?", "collection": "geo", "remember": True},
            headers={"Authorization": f"Bearer {operator_key}"},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        yield stack.url, answer.json()["message_id"], answer.json()["conversation_id"]


@AGENT.parametrize()
def test_agent(case: Any, agent_ids: tuple[str, str, str], operator_key: str) -> None:
    url, message_id, conversation_id = agent_ids
    use_real_values(
        case,
        path={"message_id": message_id, "conversation_id": conversation_id},
        body={"message_id": message_id, "conversation_id": conversation_id},
    )
    check(case, url, operator_key)


# -- the schemas themselves --------------------------------------------------------------------

PUBLIC = {
    "/healthz",
    "/readyz",
    "/metrics",
    # the agent's sign-in, before there is a key: no guard's 401, no tenant limit's 429
    "/v1/auth/config",
    "/v1/auth/oidc/login",
    "/v1/auth/oidc/callback",
    "/v1/auth/logout",
}


@pytest.mark.parametrize(
    "schema", [INFERENCE, RETRIEVAL, TRAINER, AGENT], ids=["inference", "retrieval", "trainer", "agent"]
)
def test_every_operation_declares_the_errors_it_answers_in_the_one_error_shape(schema: Any) -> None:
    """No FastAPI 422 (invalid input is a 400), and every route behind a key declares the
    guard's 400, 401, 413 and 429, each error with the one error shape."""
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    document = schema.raw_schema
    assert "HTTPValidationError" not in document["components"]["schemas"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            if path not in PUBLIC:
                assert {"400", "401", "413", "429"} <= set(responses), (method, path)
            for status, response in responses.items():
                if status.startswith("4"):
                    assert response["content"] == error, (method, path, status)
