"""LangChain's standard integration tests (``langchain-tests``) against the agent's OpenAI facade.

``ChatOpenAI`` is pointed at the agent service, whose chat pipeline (``chat-documents`` over a small
collection, the ``collection`` riding in ``extra_body``) generates through the real inference
service on the real SmolLM2-135M-Instruct: tools, ``tool_choice``, structured output and usage pass
through the pipeline's generation step. What the protocol must do passes here. A test that asserts
what a 135M model says (``XFAIL`` of tests/inference/test_langchain_standard.py) runs once, in that
module, as a strict xfail naming the model's failure; here it is skipped with that reason, since
the same model behind the facade says the same. About 2 minutes on the shared 2-core machine: e2e,
run in CI.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.agent.stack import RealStack, new_key, real_services
from tests.helpers.models import smollm2_dir
from tests.inference.test_langchain_standard import MODEL_FAILURES, MODEL_PASSES, RECORDED_KIND, XFAIL

# under a name pytest does not collect: only its subclass below runs here
from tests.inference.test_langchain_standard import TestInferenceChatOpenAI as InferenceSuite

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

# What the model writes behind the facade where it differs from the inference module's record
# (greedy, on the recorded kind of CPU: without AMX, where the default plan multiplies prompt rows
# as int8 times the int4 blocks): a strict xfail naming the model's failure there
FACADE_XFAIL = {
    "test_bind_runnables_as_tools": "behind the chat-documents pipeline (its retrieved passages in the "
    "prompt), SmolLM2-135M answers in text instead of calling the bound runnable",
}

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
    model = smollm2_dir()
    with real_services(
        redis_url,
        tmp_path_factory.mktemp("langchain-facade"),
        model,
        new_key(redis_url, "acme-langchain"),
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


class TestFacadeChatOpenAI(InferenceSuite):
    """The inference suite's class (its declared features and ``tool_choice_value``) against the
    facade: ``model`` names the pipeline, the collection rides in ``extra_body``."""

    @pytest.fixture(autouse=True)
    def _server(self, facade: RealStack, request: pytest.FixtureRequest) -> None:
        type(self).base_url, type(self).api_key = facade.agent + "/v1", facade.key
        reason = XFAIL.get(request.node.originalname)
        if reason:
            pytest.skip(
                f"model quality, asserted once by tests/inference/test_langchain_standard.py: {reason}"
            )
        name = request.node.originalname
        if not RECORDED_KIND and (name in MODEL_PASSES or name in FACADE_XFAIL):
            # what the model writes, recorded on CPUs without AMX (see the inference module)
            why = "greedy outcomes are recorded on CPUs without AMX; AMX kernels move near ties"
            request.applymarker(pytest.mark.xfail(reason=why, strict=False))
        elif name in FACADE_XFAIL:
            request.applymarker(
                pytest.mark.xfail(reason=FACADE_XFAIL[name], strict=True, raises=MODEL_FAILURES)
            )

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {
            **super().chat_model_params,
            "model": "chat-documents",
            "extra_body": {"collection": "facts"},
            "max_tokens": MAX_TOKENS,
            "http_async_client": httpx.AsyncClient(timeout=300),
        }
