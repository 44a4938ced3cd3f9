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
from langchain_openai import ChatOpenAI
from langchain_tests.integration_tests import ChatModelIntegrationTests

from services.common.config import CommonSettings
from services.common.platforms import cpu_amx_usable
from services.inference.app import create_app
from services.inference.config import InferenceSettings
from tests.helpers.models import smollm2_dir
from tests.helpers.servers import serve_app

# anyio runs the suite's async tests (langchain-tests expects an async plugin in auto mode)
pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

SERVED = "smollm2"

# What SmolLM2-135M says, not the protocol: every call here parses and validates against its
# schema, and the same tests pass on the protocol checks before these assertions. Each is a strict
# xfail naming the model's failure: a case that starts to pass fails the run, so a better model or
# plan removes its mark instead of hiding a regression. The suite asks for greedy answers
# (``temperature`` 0 below), which the engine gives bit for bit alike on every run, alone or in a
# batch, with or without a prefix-cache hit, so each case passes or fails the same way every run on
# one CPU kind. The outcomes here are those of the default plan on an AVX512 CPU without AMX; with
# AMX the output head and the prompt's bf16 products are oneDNN's AMX kernels, whose near ties may
# differ, so there (``RECORDED_KIND`` false) the cases that assert what the model writes, these and
# ``MODEL_PASSES``, are non-strict xfails until their outcomes are recorded on such a CPU. Only the model's failures are
# expected (``MODEL_FAILURES``): a reply that does not parse or validate (OutputParserException,
# pydantic's ValidationError), an HTTP error or anything else still fails the test. They run here
# only: the facade's run of this class (tests/agent/test_langchain_facade.py) skips them, since the
# same model says the same.
MODEL_FAILURES: tuple[type[BaseException], ...] = (AssertionError, openai.LengthFinishReasonError)
_UNCLOSED = (
    "json_schema: SmolLM2-135M never closes the object the schema's grammar holds it to; it writes "
    "until the context is full (2006-2011 of 2048 tokens), so the client's parse meets finish_reason 'length'"
)
XFAIL = {
    "test_tool_calling_with_no_arguments": "forced to call (tool_choice 'required', parallel calls "
    "allowed as the suite sends), SmolLM2-135M writes eight calls of magic_function_no_args where "
    "the test expects one",
    "test_agent_loop": "tool_choice 'auto': SmolLM2-135M answers the weather question in text "
    "instead of calling get_weather (a model choice; forced calls pass in test_tool_calling)",
    "test_json_mode": "json_object: SmolLM2-135M never closes its object; it writes until the context "
    "is full (1987 tokens), so the client's parse meets finish_reason 'length'",
    "test_structured_output": _UNCLOSED,
    "test_structured_output_async": _UNCLOSED,
    "test_structured_output_optional_param": _UNCLOSED,
    "test_structured_output_pydantic_2_v1": _UNCLOSED,
    "test_unicode_tool_call_integration": "forced to call unicode_customer for the Chinese name, "
    "SmolLM2-135M writes the call's arguments until the context is full (2048 tokens); a call cut by "
    "the length limit comes back as content, with no tool_calls",
}

# Cases that assert what the model writes and that it gets right (greedy, on the recorded kind).
MODEL_PASSES = {
    "test_tool_calling",
    "test_tool_calling_async",
    "test_bind_runnables_as_tools",
    "test_tool_choice",
    "test_structured_few_shot_examples",
}
RECORDED_KIND = not cpu_amx_usable()


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
        name = request.node.originalname
        reason = XFAIL.get(name)
        if not RECORDED_KIND and (reason or name in MODEL_PASSES):
            why = "greedy outcomes are recorded on CPUs without AMX; AMX kernels move near ties"
            request.applymarker(pytest.mark.xfail(reason=f"{why} ({reason or 'passes there'})", strict=False))
        elif reason:
            request.applymarker(pytest.mark.xfail(reason=reason, strict=True, raises=MODEL_FAILURES))

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
            # the integration suite's own params are empty and ChatOpenAI sends no temperature
            # unless given one, so the server would sample at the API's default 1.0, unseeded:
            # greedy makes each case's answer the same on every run
            "temperature": 0,
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
