"""Tool calls in each model family's own format: the family's published chat template
(tests/data/chat_templates, see its README) renders a tool conversation, and the family's
tool-call output is read back, whole and streamed through the server's chunk builder."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.common.openai_wire import ChatChunkChoice
from services.inference.engine import tool_formats
from services.inference.engine.tool_formats import FORMATS, ToolFormat
from services.inference.engine.tools import (
    chat_template_input,
    parse_tool_calls,
    template_renders_calls,
    template_renders_tools,
)
from services.inference.engine.types import PromptMessage, SamplingParams, StreamEvent
from services.inference.serving import OpenAIServing, ToolPlan, _Choice
from tests.inference.schemas import ADD_PARAMETERS, function_tool

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
WEATHER = function_tool(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"],
    },
    "The weather in a city now.",
)
TOOLS = [WEATHER, function_tool("add", ADD_PARAMETERS)]
PARIS = {"city": "Paris", "unit": "celsius"}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(PARIS)},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    {"role": "user", "content": "And what is 2 plus 3?"},
]


@dataclass(frozen=True)
class Family:
    template: str  # file under tests/data/chat_templates ("" : SmolLM2's own)
    model_type: str
    format: str
    # the call history and the tool's result, as the rendered prompt must show them
    shows: tuple[str, ...]
    # what the family's model writes to call get_weather(Paris) and add(2, 3), and the content before
    output: str
    content: str = ""


FAMILIES = {
    "qwen2.5": Family(
        "qwen2.5.jinja",
        "qwen2",
        "hermes",
        (
            '<tools>\n{"type": "function", "function": {"name": "get_weather"',
            '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call><|im_end|>',
            "<|im_start|>user\n<tool_response>\n18 C and sunny\n</tool_response><|im_end|>",
        ),
        'I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        "I will look both up.",
    ),
    "qwen3": Family(
        "qwen3.jinja",
        "qwen3",
        "hermes",
        (
            "# Tools\n\nYou may call one or more functions",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call><|im_end|>',
            "<tool_response>\n18 C and sunny\n</tool_response>",
        ),
        "<think>\nTwo lookups.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        "<think>\nTwo lookups.\n</think>",
    ),
    "llama3.2": Family(
        "llama3.2.jinja",
        "llama",
        "llama3",
        (
            "Given the following functions, please respond with a JSON for a function call",
            '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}<|eot_id|>',
            # the published template writes a result through tojson (a string is iterable in Jinja)
            '<|start_header_id|>ipython<|end_header_id|>\n\n"18 C and sunny"<|eot_id|>',
        ),
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "add", "parameters": {"a": 2, "b": 3}}',
    ),
    "granite3.3": Family(
        "granite3.3.jinja",
        "granite",
        "granite",
        (
            "<|start_of_role|>available_tools<|end_of_role|>[",
            # the template writes only content: the call goes there in Granite's own format
            '<|start_of_role|>assistant<|end_of_role|><|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]<|end_of_text|>',
            "<|start_of_role|>tool<|end_of_role|>18 C and sunny<|end_of_text|>",
        ),
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "add", "arguments": {"a": 2, "b": 3}}]',
    ),
    "gemma3": Family(
        "gemma3.jinja",
        "gemma3_text",
        "gemma",
        (
            "[function_name(argument_name=value, ...), ...]",
            "<start_of_turn>model\n```tool_code\n[get_weather(city='Paris', unit='celsius')]\n```<end_of_turn>",
            "```tool_output\n18 C and sunny\n```\n\nAnd what is 2 plus 3?<end_of_turn>",
        ),
        'Let me check.\n```tool_code\n[get_weather(city="Paris", unit="celsius"), add(a=2, b=3)]\n```',
        "Let me check.",
    ),
    "default": Family(
        "",
        "llama",
        "json",
        (
            '"name": <tool name>, "arguments": <arguments object>',
            '<|im_start|>assistant\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}<|im_end|>',
            "Result of get_weather (call call_1): 18 C and sunny",
        ),
        '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "add", "arguments": {"a": 2, "b": 3}}]',
    ),
}
EXPECTED = [("get_weather", PARIS), ("add", {"a": 2, "b": 3})]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def with_template(tokenizer: Any, family: Family) -> Any:
    tok = copy.copy(tokenizer)
    if family.template:
        tok.chat_template = (TEMPLATES / family.template).read_text()
    return tok


def calls_of(found: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in found]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_family_is_chosen_from_the_template_or_model_type(name: str, smollm2_tokenizer: Any) -> None:
    family = FAMILIES[name]
    template = with_template(smollm2_tokenizer, family).chat_template
    fmt, why = tool_formats.select(family.model_type, template)
    assert fmt.name == family.format, why
    # a template without markers falls back to the config's model_type
    assert tool_formats.select("qwen3", None)[0].name == "hermes"
    assert tool_formats.select("granitemoehybrid", None)[0].name == "hermes"
    assert tool_formats.select("gemma3_text", "")[0].name == "gemma"
    assert tool_formats.select("gpt2", None)[0].name == "json"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_family_template_renders_a_tool_conversation(name: str, smollm2_tokenizer: Any) -> None:
    family = FAMILIES[name]
    tok = with_template(smollm2_tokenizer, family)
    fmt = FORMATS[family.format]
    typed = [PromptMessage.from_openai(m, i) for i, m in enumerate(CONVERSATION)]
    messages, extra = chat_template_input(
        typed, TOOLS, lambda: template_renders_tools(tok), fmt, lambda: template_renders_calls(tok)
    )
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    for shown in family.shows:
        assert shown in prompt, f"{shown!r} not in:\n{prompt}"
    # the tools' schemas reach the model, and the turn ends with the assistant's to write
    assert "get_weather" in prompt.split("Weather in Paris?")[0] + prompt.split("Weather in Paris?")[-1]
    assert '"city"' in prompt and "And what is 2 plus 3?" in prompt
    # the history's call reads back as the call it was, in the family's own format
    written = fmt.call_text([("get_weather", PARIS)])
    assert calls_of(parse_tool_calls(written, TOOLS, fmt) or []) == [("get_weather", PARIS)]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_family_output_is_read_whole(name: str) -> None:
    family = FAMILIES[name]
    found = FORMATS[family.format].parse(family.output, TOOLS)
    assert found is not None
    assert calls_of(found.calls) == EXPECTED
    assert found.content.strip() == family.content
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in found.calls)


def stream(
    fmt: ToolFormat, pieces: list[str], tools: list[dict[str, Any]], forced: bool = False
) -> dict[str, Any]:
    """The server's chunks for ``pieces`` streamed one event each: the content, when it was
    sent (the index of the event it came with), the calls and the finish reason."""
    plan = ToolPlan(tools, "required" if forced else "auto", format=fmt)
    _first, step = OpenAIServing._chat_steps(SamplingParams(), plan, 1)
    choice = _Choice()
    content, first_content_at, deltas, finish = "", None, {}, None
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        ev = StreamEvent(0, [], piece, None, "stop" if last else None, 1, i + 1)
        for chunk in [c for out in step(ev, choice) for c in out]:
            assert isinstance(chunk, ChatChunkChoice)
            if chunk.delta.content:
                content += chunk.delta.content
                first_content_at = i if first_content_at is None else first_content_at
            for d in chunk.delta.tool_calls or []:
                slot = deltas.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                if d.function is not None:
                    slot["name"] += d.function.name or ""
                    slot["arguments"] += d.function.arguments or ""
            finish = chunk.finish_reason or finish
    calls = [(d["name"], json.loads(d["arguments"])) for _, d in sorted(deltas.items())]
    return {"content": content, "at": first_content_at, "calls": calls, "finish": finish}


def token_pieces(tokenizer: Any, text: str) -> list[str]:
    """``text`` in the pieces a model streams it in: one token's text each."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces, before = [], ""
    for k in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:k])
        pieces.append(now[len(before) :])
        before = now
    assert "".join(pieces) == text
    return pieces


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_family_output_is_read_streamed(name: str, smollm2_tokenizer: Any) -> None:
    family = FAMILIES[name]
    fmt = FORMATS[family.format]
    pieces = token_pieces(smollm2_tokenizer, family.output)
    got = stream(fmt, pieces, TOOLS)
    assert got["calls"] == EXPECTED and got["finish"] == "tool_calls"
    assert got["content"].strip() == family.content
    if family.content:
        # the content before the call streams as it comes, not at the end
        assert got["at"] is not None and got["at"] < len(pieces) - 1
    # streamed and whole agree
    whole = fmt.parse(family.output, TOOLS)
    assert whole is not None and calls_of(whole.calls) == got["calls"]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_plain_answer_streams_as_content(name: str, smollm2_tokenizer: Any) -> None:
    fmt = FORMATS[FAMILIES[name].format]
    text = "It is 18 C and sunny in Paris; 2 + 3 = 5 <b>bold</b> [note] add it up."
    pieces = token_pieces(smollm2_tokenizer, text)
    got = stream(fmt, pieces, TOOLS)
    assert got == {"content": text, "at": 0, "calls": [], "finish": "stop"}
    assert fmt.parse(text, TOOLS) is None


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_forced_call_in_the_default_json_is_read_by_every_family(name: str, smollm2_tokenizer: Any) -> None:
    """``tool_choice`` forces the JSON grammar of call_schema, whatever the family."""
    fmt = FORMATS[FAMILIES[name].format]
    forced = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
    assert calls_of(parse_tool_calls(forced, TOOLS, fmt) or []) == [("add", {"a": 2, "b": 3})]
    got = stream(fmt, token_pieces(smollm2_tokenizer, forced), TOOLS, forced=True)
    assert got["calls"] == [("add", {"a": 2, "b": 3})] and got["content"] == ""


def test_calls_of_tools_not_offered_or_malformed_are_content() -> None:
    hermes, gemma, llama = FORMATS["hermes"], FORMATS["gemma"], FORMATS["llama3"]
    assert hermes.parse('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', TOOLS) is None
    assert hermes.parse('<tool_call>\n{"name": "add", "arguments": {"a": 2,\n</tool_call>', TOOLS) is None
    # Gemma's calls take literal keyword arguments only: nothing is evaluated
    assert gemma.parse("[add(2, 3)]", TOOLS) is None
    assert gemma.parse("[add(a=__import__('os').getpid(), b=1)]", TOOLS) is None
    assert gemma.parse("[add(a=1, b=2)]", TOOLS) is not None
    assert llama.parse('{"name": "add", "parameters": "not an object"}', TOOLS) is None


def test_engine_chooses_the_format_from_its_template(
    tiny_model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A model whose tokenizer carries Qwen's template: the engine renders tools natively and
    reads ``<tool_call>`` blocks; its log and health name the format and why."""
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.inference.engine.torch_engine import TorchEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.chat_template = (TEMPLATES / "qwen2.5.jinja").read_text()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    engine = TorchEngine.from_model(model, tok, max_batch_size=1)
    assert engine.tool_format.name == "hermes" and "<tool_call>" in engine.tool_format_reason
    prompt = engine.tokenizer.decode(engine.encode_chat(CONVERSATION, TOOLS))
    assert "<tools>" in prompt and "<tool_response>\n18 C and sunny\n</tool_response>" in prompt

    async def health() -> dict[str, object]:
        await engine.start()
        try:
            return await engine.health()
        finally:
            await engine.shutdown()

    with caplog.at_level("INFO", logger="tandem.engine"):
        assert asyncio.run(health())["tool_format"] == "hermes"
    assert any("tool-call format" in r.getMessage() and "hermes" in r.getMessage() for r in caplog.records)


@pytest.mark.e2e  # reads and converts the default model's 49K-token GGUF vocabulary: ~40 s on 2 cores
def test_the_chat_template_inside_a_gguf_is_the_one_used(tmp_path: Path) -> None:
    """A GGUF whose ``tokenizer.chat_template`` is Qwen's: the tokenizer read from the file (as
    the llama.cpp engine and the GGUF conversion read it) carries that template, and the
    engine's format follows it."""
    import gguf
    from transformers import AutoTokenizer

    from services.inference.engine.loader import default_gguf_path

    qwen = (TEMPLATES / "qwen2.5.jinja").read_text()
    writer = gguf.GGUFWriter(str(tmp_path / "templated.gguf"), "llama")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 8)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    for name, field in gguf.GGUFReader(str(default_gguf_path())).fields.items():
        if name.startswith("tokenizer.") and name != "tokenizer.chat_template":
            vtype = field.types[0]
            sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.add_chat_template(qwen)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="templated.gguf")
    assert tok.chat_template.strip() == qwen.strip()
    assert tool_formats.select("llama", tok.chat_template)[0].name == "hermes"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "<tools>" in prompt and prompt.endswith("<|im_start|>assistant\n")
