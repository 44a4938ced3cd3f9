"""Conformance: the official ``openai`` client against a real server (torch engine, tiny random
model) over structured output, tool calling, sampling controls and validation, streaming and not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from services.common.config import CommonSettings
from services.inference.app import create_app
from services.inference.config import InferenceSettings
from tests.helpers.servers import serve_app
from tests.inference.schemas import ADD_PARAMETERS, THING_SCHEMA, function_tool

SCHEMA = THING_SCHEMA
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
ADD = function_tool("add", ADD_PARAMETERS, "Add two numbers.")
ECHO = {
    "type": "function",
    "function": {
        "name": "shout",
        "parameters": {
            "type": "object",
            "properties": {"word": {"enum": ["hey", "ho"]}},
            "required": ["word"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [ADD, ECHO]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}  # type: ignore[index]
USER = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def client(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, key: str, lively_tiny_path: Path
) -> Iterator[openai.OpenAI]:
    home = tmp_path_factory.mktemp("openai-client-home")
    common = CommonSettings(home=home, redis_url=redis_url, model_roots=str(home / "models"), log_json=False)
    settings = InferenceSettings(
        model=str(lively_tiny_path), served_model_name="tiny", max_model_len=1024, max_batch_size=8
    )
    with serve_app(create_app(common, settings)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def _bad(call: Any, param: str) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    body = err.value.body
    assert isinstance(body, dict)
    assert set(body) >= {"message", "type", "param", "code"}, body
    assert body["param"] == param, body
    return body


# --- structured output ---------------------------------------------------------------------------


def test_json_schema_chat_and_completions_always_validate(client: openai.OpenAI) -> None:
    for seed in (1, 50, 99):
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Give me a thing."}],
            response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
            temperature=1.0,
            seed=seed,
            n=4,
            max_tokens=80,
        )
        for choice in out.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    comp = client.completions.create(
        model="tiny",
        prompt="A thing:",
        max_tokens=80,
        n=3,
        seed=7,
        extra_body={"response_format": RESPONSE_FORMAT},
    )
    for c in comp.choices:
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_json_schema_streamed(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Give me a thing."}],
            response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
            seed=3,
            max_tokens=80,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_with_logit_bias(client: openai.OpenAI) -> None:
    """json_object gives an object; a +100 bias on "}" makes the random model close it at once."""
    from transformers import AutoTokenizer

    from tests.helpers.models import smollm2_dir

    close = AutoTokenizer.from_pretrained(smollm2_dir()).convert_tokens_to_ids("}")
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"},
        logit_bias={str(close): 100},
        max_tokens=40,
        seed=1,
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)


# --- tool calling -----------------------------------------------------------------------------------


def _check_calls(calls: Any, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_tool_choice(client: openai.OpenAI) -> None:
    for seed in (1, 2, 3):
        out = client.chat.completions.create(
            model="tiny",
            messages=USER,
            tools=TOOLS,
            tool_choice="required",
            seed=seed,
            n=3,
            max_tokens=200,  # type: ignore[arg-type]
        )
        for choice in out.choices:
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content is None
            _check_calls(choice.message.tool_calls, {"add", "shout"})
    named = client.chat.completions.create(
        model="tiny",
        messages=USER,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "shout"}},
        seed=4,
        n=3,
        max_tokens=60,
    )
    for choice in named.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls or []) == 1
        _check_calls(choice.message.tool_calls, {"shout"})
    single = client.chat.completions.create(
        model="tiny",
        messages=USER,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        seed=5,
        max_tokens=60,
    )
    assert len(single.choices[0].message.tool_calls or []) == 1


def test_auto_and_none_may_answer_in_text(client: openai.OpenAI) -> None:
    for choice_name in ("auto", "none"):
        out = client.chat.completions.create(
            model="tiny",
            messages=USER,
            tools=TOOLS,
            tool_choice=choice_name,
            max_tokens=8,
            temperature=0,  # type: ignore[arg-type]
        )
        msg = out.choices[0].message
        if msg.tool_calls:
            assert choice_name == "auto" and out.choices[0].finish_reason == "tool_calls"
        else:
            assert msg.content and out.choices[0].finish_reason == "length"


def test_streamed_tool_calls_in_openai_chunk_shape(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=USER,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required",
            seed=6,
            max_tokens=200,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas
    by_index: dict[int, dict[str, str]] = {}
    for d in deltas:
        if d.id is not None:  # the first delta of a call: index, id, type, name, empty arguments
            assert d.index not in by_index and d.type == "function" and d.function is not None
            assert d.function.name and d.function.arguments == ""
            by_index[d.index] = {"name": d.function.name, "arguments": ""}
        else:
            assert d.function is not None and d.function.name is None
            by_index[d.index]["arguments"] += d.function.arguments or ""
    assert sorted(by_index) == list(range(len(by_index)))
    for call in by_index.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["tool_calls"]
    assert chunks[-1].usage is not None


def test_tool_results_in_history(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny",
        messages=[  # type: ignore[list-item]
            *USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        ],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        max_tokens=5,
    )
    assert out.choices[0].message.content is not None
    assert out.usage is not None and out.usage.prompt_tokens > 100  # the tools and the call were rendered


# --- sampling controls ------------------------------------------------------------------------------


def test_logit_bias_and_penalties_change_greedy_output(client: openai.OpenAI) -> None:
    base = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=1, temperature=0, logprobs=0)
    first = base.choices[0].logprobs.tokens[0]  # type: ignore[union-attr,index]
    from transformers import AutoTokenizer

    from tests.helpers.models import smollm2_dir

    (tid,) = AutoTokenizer.from_pretrained(smollm2_dir())(first, add_special_tokens=False)["input_ids"]
    banned = client.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=1, temperature=0, logit_bias={str(tid): -100}
    )
    assert banned.choices[0].text != base.choices[0].text
    for extra in (
        {"presence_penalty": 1.5},
        {"frequency_penalty": -1.0},
        {"min_p": 0.1},
        {"repetition_penalty": 1.3},
    ):
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            seed=1,
            **{k: v for k, v in extra.items() if k in ("presence_penalty", "frequency_penalty")},  # type: ignore[arg-type]
            extra_body={k: v for k, v in extra.items() if k in ("min_p", "repetition_penalty")},
        )
        assert out.choices[0].message.content is not None


def test_echo_and_suffix(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt="Once upon", max_tokens=3, temperature=0, echo=True)
    assert out.choices[0].text.startswith("Once upon")
    plain = client.completions.create(model="tiny", prompt="Once upon", max_tokens=3, temperature=0)
    assert out.choices[0].text == "Once upon" + plain.choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="Once upon", max_tokens=3, temperature=0, echo=True, stream=True
        )
        if c.choices
    )
    assert streamed == out.choices[0].text
    body = _bad(
        lambda: client.completions.create(model="tiny", prompt="def f(", suffix="return x", max_tokens=3),
        "suffix",
    )
    assert "fill-in-the-middle" in body["message"]


# --- validation parity ------------------------------------------------------------------------------


def test_validation_parity(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create
    msgs = [{"role": "user", "content": "x"}]
    _bad(lambda: chat(model="tiny", messages=msgs, stream_options={"include_usage": True}), "stream_options")  # type: ignore[arg-type]
    _bad(lambda: chat(model="tiny", messages=msgs, seed=2**64), "seed")  # type: ignore[arg-type]
    _bad(lambda: chat(model="tiny", messages=msgs, extra_body={"stop_token_ids": [-1]}), "stop_token_ids")  # type: ignore[arg-type]
    _bad(lambda: chat(model="tiny", messages=msgs, extra_body={"stop_token_ids": [10**7]}), "stop_token_ids")  # type: ignore[arg-type]
    _bad(lambda: chat(model="tiny", messages=msgs, logit_bias={"x": 1}), "logit_bias")  # type: ignore[arg-type,dict-item]
    _bad(
        lambda: chat(
            model="tiny",
            messages=msgs,  # type: ignore[arg-type]
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },  # type: ignore[typeddict-item]
        ),
        "response_format.json_schema.schema",
    )
    # valid JSON Schema, but a regex xgrammar cannot compile
    lookbehind = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}},
    }
    body = _bad(
        lambda: chat(model="tiny", messages=msgs, response_format=lookbehind),  # type: ignore[arg-type]
        "response_format.json_schema.schema",
    )
    assert body["message"].startswith(
        "response_format.json_schema.schema: the grammar could not be compiled: "
    )
    assert "Lookbehind" in body["message"] and "/project/" not in body["message"]
    _bad(lambda: chat(model="tiny", messages=msgs, response_format={"type": "yaml"}), "response_format.type")  # type: ignore[arg-type,typeddict-item,misc]
    _bad(
        lambda: chat(
            model="tiny", messages=msgs, tools=[{"type": "function", "function": {"parameters": {}}}]
        ),  # type: ignore[arg-type,list-item,typeddict-item]
        "tools[0].function.name",
    )
    _bad(
        lambda: chat(
            model="tiny",
            messages=msgs,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "missing"}},
        ),
        "tool_choice",
    )
    _bad(
        lambda: chat(model="tiny", messages=msgs, extra_body={"guided_grammar": "root ::= ("}),
        "guided_grammar",
    )  # type: ignore[arg-type]
    # completions' logprobs=0 report the sampled token itself
    comp = client.completions.create(model="tiny", prompt="hi", max_tokens=3, logprobs=0, temperature=0)
    lp = comp.choices[0].logprobs
    assert lp is not None and lp.top_logprobs and lp.tokens and lp.token_logprobs
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top == {token: value}
    # the service keeps serving
    assert chat(model="tiny", messages=msgs, max_tokens=2).choices[0].message.content is not None  # type: ignore[arg-type]


def test_auto_streamed_text_equals_unstreamed(client: openai.OpenAI) -> None:
    """With tools offered, a text answer still streams (held back only while it may be a call)."""
    args: dict[str, Any] = {
        "model": "tiny",
        "messages": USER,
        "tools": TOOLS,
        "max_tokens": 12,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True))
    msg = whole.choices[0].message
    if msg.tool_calls:  # the random model happened to call: the stream says so too
        assert any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    else:
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
            whole.choices[0].finish_reason
        ]
