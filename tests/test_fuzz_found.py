"""What the API fuzzer (tests/test_fuzz.py) found, kept as plain regression tests: each was a
500 or an answer the OpenAPI schema did not declare, and is now a 4xx naming the field and
the value, in the one error shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.common.config import CommonSettings
from services.common.errors import InvalidRequest
from services.common.paths import resolve_under_roots
from tests.conftest import auth
from tests.helpers.servers import serve_app


@pytest.fixture()
def trainer(tandem_env: Path, tiny_model_path: Path, api_key: str) -> Iterator[tuple[httpx.Client, str]]:
    """The trainer over real HTTP (jobs are queued, not run) and an uploaded dataset's id."""
    from services.trainer.app import create_app
    from services.trainer.config import TrainerSettings

    common = CommonSettings(model_roots=str(tiny_model_path.parent))
    app = create_app(common, TrainerSettings())
    app.state.trainer.dispatch = lambda job_id, queue: None
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    with serve_app(app) as url, httpx.Client(base_url=url, headers=auth(api_key), timeout=60) as client:
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
        up = client.post("/v1/files", files={"file": ("train.jsonl", data)})
        assert up.status_code == 201, up.text
        yield client, up.json()["id"]


@pytest.mark.parametrize("value", ["~nosuchuser-fuzz/model", "/models/\ud829\udfc9"])
def test_a_path_the_file_system_cannot_take_is_a_400_naming_it(tmp_path: Path, value: str) -> None:
    """``~user`` with no such user made expanduser raise RuntimeError, a lone surrogate made
    the file system calls raise UnicodeEncodeError: both were 500s."""
    with pytest.raises(InvalidRequest) as caught:
        resolve_under_roots(value, [tmp_path], param="path")
    assert caught.value.param == "path" and repr(value) in caught.value.message


def test_a_job_whose_base_model_is_under_an_unknown_home_is_a_400(trainer: tuple[httpx.Client, str]) -> None:
    client, file_id = trainer
    spec = {"type": "sft", "base_model": "~nosuchuser-fuzz/model", "dataset": file_id}
    resp = client.post("/v1/jobs", json=spec)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "base_model" and "~nosuchuser-fuzz/model" in error["message"]


@pytest.fixture()
def agent(redis_url: str, tmp_path: Path, api_key: str) -> Iterator[httpx.Client]:
    from tests.agent.stack import agent_stack

    with (
        agent_stack(redis_url, tmp_path / "home") as stack,
        httpx.Client(base_url=stack.url, headers=auth(api_key), timeout=60) as client,
    ):
        yield client


def test_a_feedback_offset_beyond_64_bits_is_a_400_naming_it(agent: httpx.Client) -> None:
    """SQLite's integers are 64-bit: binding a larger offset raised OverflowError (a 500)."""
    resp = agent.get("/v1/feedback", params={"offset": 2**64})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "offset" and str(2**64) in error["message"]
    assert agent.get("/v1/feedback", params={"offset": 2**63 - 1}).json()["data"] == []


def test_a_document_list_offset_beyond_64_bits_is_a_400_naming_it(tandem_env: Path, api_key: str) -> None:
    """The same in retrieval's document list: OverflowError from SQLite was a 500."""
    from services.retrieval.app import create_app
    from services.retrieval.config import RetrievalSettings
    from tests.conftest import TEST_CACHE
    from tests.retrieval.conftest import make_tiny_embedder

    (TEST_CACHE / "retrieval-models").mkdir(parents=True, exist_ok=True)
    embedder = make_tiny_embedder(TEST_CACHE / "retrieval-models" / "tiny-embedder")
    common = CommonSettings(model_roots=str(embedder.parent))
    app = create_app(common, RetrievalSettings(embedding_model=str(embedder)))
    with serve_app(app) as url, httpx.Client(base_url=url, headers=auth(api_key), timeout=60) as c:
        assert c.post("/v1/collections", json={"name": "kb"}).status_code == 201
        resp = c.get("/v1/collections/kb/documents", params={"offset": 2**64})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "offset" and str(2**64) in error["message"]
        assert c.get("/v1/collections/kb/documents", params={"offset": 2**63 - 1}).json()["documents"] == []
