"""The response models' JSON is OpenAI's to the key (what SDKs and SSE parsers see), and
engine errors reach HTTP by their type, never by their message."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.common.openai_wire import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    FunctionDelta,
    TextCompletion,
    ToolCallDelta,
    Usage,
)
from services.inference.engine.base import AdapterNotFound, NameTaken
from services.inference.engine.types import AdapterError, UnknownModel
from services.inference.serving import http_error


def _chunk(**fields: object) -> ChatCompletionChunk:
    return ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", **fields)  # type: ignore[arg-type]


def test_chunk_keys_and_nulls_are_openais() -> None:
    first = _chunk(choices=[ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content=""))])
    assert json.dumps(first.model_dump()) == (
        '{"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m", '
        '"system_fingerprint": null, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, '
        '"logprobs": null, "finish_reason": null}]}'
    )
    # with include_usage every chunk carries usage (null until the last)
    assert _chunk(choices=[], usage=None).model_dump()["usage"] is None
    last = _chunk(choices=[], usage=Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5))
    assert last.model_dump()["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    finish = ChatChunkChoice(index=1, delta=ChatDelta(), finish_reason="stop").model_dump()
    assert finish == {"index": 1, "delta": {}, "logprobs": None, "finish_reason": "stop"}


def test_tool_call_deltas_carry_what_was_given() -> None:
    head = ToolCallDelta(
        index=0, id="call_1", type="function", function=FunctionDelta(name="add", arguments="")
    )
    assert head.model_dump() == {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": ""},
    }
    assert ToolCallDelta(index=0, function=FunctionDelta(arguments='{"a"')).model_dump() == {
        "index": 0,
        "function": {"arguments": '{"a"'},
    }
    # an upstream's delta passes through as it came, its own extra fields included
    upstream = {"index": 1, "function": {"arguments": "1}"}, "x_extra": True}
    assert ToolCallDelta.model_validate(upstream).model_dump() == upstream


def test_text_completion_usage_only_when_given() -> None:
    choice = CompletionChoice(index=0, text="hi", finish_reason=None)
    chunk = TextCompletion(id="cmpl-1", created=1, model="m", choices=[choice]).model_dump()
    assert list(chunk) == ["id", "object", "created", "model", "system_fingerprint", "choices"]
    assert chunk["choices"] == [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}]


@pytest.mark.parametrize(
    ("exc", "status", "param", "code"),
    [
        (NameTaken("a1"), 409, None, None),
        (AdapterNotFound("a1"), 404, "lora_name", "adapter_not_found"),
        (UnknownModel("The model `x` does not exist."), 404, "model", "model_not_found"),
        (AdapterError("lora_path 'p' is not a folder"), 400, "lora_path", None),
    ],
)
def test_engine_errors_map_by_type(exc: Exception, status: int, param: str | None, code: str | None) -> None:
    err = http_error(exc)  # type: ignore[arg-type]
    assert (err.status_code, err.param, err.code) == (status, param, code)
    assert err.message == str(exc)


def test_torch_engine_adapter_names_raise_typed_errors(lively_tiny_path: Path, tmp_path: Path) -> None:
    from services.inference.engine.torch_engine import TorchEngine

    engine = TorchEngine.from_pretrained(lively_tiny_path, name="tiny", max_batch_size=1)
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    with pytest.raises(NameTaken, match="'tiny'"):
        engine.load_adapter_sync("tiny", str(tmp_path))  # the base model's own name
    with pytest.raises(AdapterNotFound, match="'nope'"):
        asyncio.run(engine.unload_adapter("nope"))
    assert engine.serves("tiny") and not engine.serves("nope")
    assert [(m.id, m.kind) for m in asyncio.run(engine.models())] == [("tiny", "base")]
