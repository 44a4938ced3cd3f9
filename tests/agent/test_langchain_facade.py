"""LangChain's standard integration tests (``langchain-tests``) against the agent's OpenAI facade.

``ChatOpenAI`` is pointed at the agent service, whose chat pipeline (``chat-documents`` over a small
collection, the ``collection`` riding in ``extra_body``) generates through the real inference
service on the real SmolLM2-135M-Instruct: tools, ``tool_choice``, structured output and usage pass
through the pipeline's generation step. The pattern of tests/inference/test_langchain_standard.py:
what the protocol must do passes; a test that asserts what a 135M model says is a non-strict xfail
limited to the model's failures (``MODEL_FAILURES``), with the reason (that module's: here a
looping string meets ``MAX_TOKENS``, not the full context). About 2 minutes on the shared 2-core
machine (33 passed, 6 xfailed or xpassed as greedy near-ties go, 11 skipped): e2e, run in CI.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from langchain_openai import ChatOpenAI
from langchain_tests.integration_tests import ChatModelIntegrationTests

from tests.agent.stack import RealStack, real_services
from tests.helpers.models import smollm2_dir
from tests.inference.test_langchain_standard import JSON_MODE_FAILURES, MODEL_FAILURES, XFAIL

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

# The pipeline's answer budget (the facade never raises it): long enough for the suite's JSON
# answers and calls to close, short enough that a looping one ends in seconds.
MAX_TOKENS = 256
DOCS = [
    {
        "id": "weather",
        "title": "Weather in San Francisco",
        "text": "San Francisco is often foggy in summer. Its weather is mild all year.",
    },
    {
        "id": "jokes",
        "title": "Jokes about cats",
        "text": "A joke has a setup and a punchline. Cats are a favourite subject of jokes.",
    },
]


@pytest.fixture(scope="module")
def facade(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[RealStack]:
    from services.common.auth import KeyStore
    from services.common.redis_conn import sync_redis

    model = smollm2_dir()
    key = KeyStore(sync_redis(redis_url)).create("acme-langchain")[0]
    with real_services(
        redis_url,
        tmp_path_factory.mktemp("langchain-facade"),
        model,
        key,
        DOCS,
        inference={"max_batch_size": 8},
        tokenizer=str(model),
        max_answer_tokens=MAX_TOKENS,
        grounding_embedder=False,
    ) as stack:
        yield stack


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class TestFacadeChatOpenAI(ChatModelIntegrationTests):
    base_url = ""
    api_key = ""

    @pytest.fixture(autouse=True)
    def _server(self, facade: RealStack, request: pytest.FixtureRequest) -> None:
        type(self).base_url, type(self).api_key = facade.agent + "/v1", facade.key
        reason = XFAIL.get(request.node.originalname)
        if reason:
            raises = JSON_MODE_FAILURES if request.node.originalname == "test_json_mode" else MODEL_FAILURES
            request.applymarker(pytest.mark.xfail(reason=reason, strict=False, raises=raises))

    @property
    def chat_model_class(self) -> type[ChatOpenAI]:
        return ChatOpenAI

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {
            "model": "chat-documents",
            "base_url": self.base_url,
            "api_key": self.api_key,
            "extra_body": {"collection": "facts"},
            "max_tokens": MAX_TOKENS,
            "max_retries": 0,
            "stream_usage": True,
            # a fresh async client per test: anyio gives each test its own event loop
            "http_async_client": httpx.AsyncClient(timeout=300),
        }

    @property
    def tool_choice_value(self) -> str:
        return "any"

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return False  # ``model`` names the pipeline
