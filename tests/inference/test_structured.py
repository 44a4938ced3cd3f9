"""The torch engine's structured generation and per-request logit processors, as a library:
constrained outputs always validate (tiny random model; the real SmolLM2 in e2e), constrained
and free requests share a batch without disturbing each other, and each sampling control
changes the distribution exactly as specified."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from services.inference.engine import SamplingParams, TorchEngine
from services.inference.engine.sampling import RowSampling, sample
from services.inference.engine.tools import call_schema, chat_template_input, parse_tool_calls
from services.inference.engine.types import GuidedDecoding, InvalidParams, PromptMessage
from tests.inference.schemas import ADD_PARAMETERS, THING_SCHEMA, function_tool

SCHEMA = THING_SCHEMA


@pytest.fixture(scope="module")
def engine(lively_tiny_path: Path) -> TorchEngine:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(lively_tiny_path)
    model = AutoModelForCausalLM.from_pretrained(lively_tiny_path, dtype=torch.float32).eval()
    return TorchEngine.from_model(model, tok, max_batch_size=8)


def _chat(engine: TorchEngine, q: str) -> list[int]:
    return engine.encode_chat([{"role": "user", "content": q}])


def test_sampled_constrained_outputs_all_validate(engine: TorchEngine) -> None:
    prompts = [_chat(engine, q) for q in ("Give me JSON.", "hi", "Describe a cat.")]
    guided = GuidedDecoding(json_schema=json.dumps(SCHEMA))
    texts = []
    for seed in (100, 200, 300):
        outs = engine.generate_batch(
            prompts, SamplingParams(temperature=1.0, max_tokens=80, seed=seed, n=4, guided=guided)
        )
        for out in outs:
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), SCHEMA)
            texts.append(out.text)
    assert len(set(texts)) > len(texts) // 2, "sampling should still vary inside the grammar"


def test_constrained_and_free_share_a_batch(engine: TorchEngine) -> None:
    """A free greedy request gives the same tokens alone and next to a constrained one."""
    prompt = _chat(engine, "Tell me a long story about a dragon.")
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = engine.generate_batch([prompt], free)[0].token_ids
    got: dict[int, Any] = {}

    def sink(i: int) -> Any:
        return lambda ev: got.setdefault(i, []).append(ev)

    guided = SamplingParams(
        temperature=1.0, max_tokens=80, seed=5, guided=GuidedDecoding(json_schema=json.dumps(SCHEMA))
    )
    grammar = engine.guided.compile(guided.guided)  # type: ignore[arg-type]
    seqs = engine._sequences("free", prompt, free, sink(0), adapter=None, timeout=None, strict=False)
    seqs += engine._sequences(
        "json",
        prompt,
        guided,
        sink(1),
        adapter=None,
        timeout=None,
        strict=False,
        index_base=1,
        grammar=grammar,
    )
    engine.scheduler.submit(seqs, bounded=False)
    engine.scheduler.run_until_done()
    assert seqs[0].output_ids == alone
    assert seqs[1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(ev.text for ev in got[1])), SCHEMA)


def test_greedy_unconstrained_unchanged_by_processors_at_defaults(engine: TorchEngine) -> None:
    model, tok = engine.model, engine.tokenizer
    prompt = _chat(engine, "What is the capital of France?")
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[
        0, len(prompt) :
    ].tolist()
    out = engine.generate_batch([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert out.token_ids == ref
    assert tok is engine.tokenizer


TOOLS: list[dict[str, Any]] = [
    function_tool("add", ADD_PARAMETERS),
    function_tool("noop", {"type": "object", "properties": {}, "additionalProperties": False}),
]


def test_forced_tool_call_parses_and_validates(engine: TorchEngine) -> None:
    tools = TOOLS
    prompt = engine.encode_chat([{"role": "user", "content": "What is 2 + 3?"}], tools)
    for parallel in (False, True):
        guided = GuidedDecoding(json_schema=json.dumps(call_schema(tools, None, parallel)), param="tools")
        outs = engine.generate_batch(
            [prompt], SamplingParams(temperature=1.0, max_tokens=250, seed=11, n=6, guided=guided)
        )
        for out in outs:
            calls = parse_tool_calls(out.text, tools)
            assert calls, out.text
            for call in calls:
                assert call.function.name in ("add", "noop")
                schema = tools[0 if call.function.name == "add" else 1]["function"]["parameters"]
                jsonschema.validate(json.loads(call.function.arguments), schema)  # type: ignore[arg-type]


def test_fallback_renders_tools_and_history(engine: TorchEngine) -> None:
    """SmolLM2's template has no tool format: the tools and the call history appear in the prompt."""
    assert engine.template_renders_tools() is False
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "find x"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"q": "x"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "x is 42"},
    ]
    text = engine.tokenizer.decode(engine.encode_chat(messages, tools))
    assert '"name": "lookup"' in text and "Result of lookup (call call_1): x is 42" in text
    assert '{"name": "lookup", "arguments": {"q": "x"}}' in text


def test_prompt_messages_read_openai_messages_and_keep_the_api_errors(engine: TorchEngine) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
    wire = [
        {
            "role": "developer",
            "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        },
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "x is 42"},
    ]
    typed = [PromptMessage.from_openai(m, i) for i, m in enumerate(wire)]
    assert [m.openai() for m in typed] == wire  # what a remote engine forwards
    assert engine.encode_chat(typed) == engine.encode_chat(wire)
    native, extra = chat_template_input(typed, [function_tool("lookup", {"type": "object"})], lambda: True)
    assert native[0] == {"role": "system", "content": "Be brief."} and "tools" in extra
    assert native[1]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": {"q": "x"}}
    for bad, message in [
        ([], "messages must not be empty"),
        ([{"content": "x"}], "messages[0] must be an object with a role"),
        ([{"role": "user", "content": 5}], "message content must be a string or a list of parts, got int"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text content parts are supported"),
    ]:
        with pytest.raises(InvalidParams) as err:
            engine.encode_chat(bad)
        assert (str(err.value), err.value.param) == (message, "messages")


def test_uncompilable_grammar_is_invalid_params(engine: TorchEngine) -> None:
    with pytest.raises(InvalidParams) as err:
        engine.guided.compile(GuidedDecoding(grammar="root ::= (", param="guided_grammar"))
    assert err.value.param == "guided_grammar"


# --- logit processors (sampling.sample on crafted logits) --------------------------------------


def _row(**kw: Any) -> RowSampling:
    out_ids = kw.pop("output_ids", None)
    prompt_ids = kw.pop("prompt_ids", None)
    return RowSampling(SamplingParams(**kw), torch.Generator().manual_seed(0), prompt_ids, out_ids)


def _processed(logits: torch.Tensor, row: RowSampling) -> torch.Tensor:
    from services.inference.engine.sampling import _process

    return _process(logits.float(), [row])[0]


def test_logit_bias_bans_and_forces() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]])
    tokens, _ = sample(logits, [_row(temperature=0, logit_bias={0: -100.0})])
    assert tokens.tolist() == [1]
    tokens, _ = sample(logits, [_row(temperature=0, logit_bias={3: 100.0})])
    assert tokens.tolist() == [3]
    # at temperature 1, a -100 bias makes the token practically impossible
    draws = [
        sample(
            logits, [RowSampling(SamplingParams(logit_bias={0: -100.0}), torch.Generator().manual_seed(s))]
        )[0].item()
        for s in range(200)
    ]
    assert 0 not in draws


def test_presence_and_frequency_penalties_are_exact() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.25]])
    out = _processed(logits, _row(presence_penalty=0.7, output_ids=[1, 1, 2]))
    assert torch.allclose(out, torch.tensor([2.0, 1.0 - 0.7, 0.5 - 0.7, 0.25]))
    out = _processed(logits, _row(frequency_penalty=0.5, output_ids=[1, 1, 2]))
    assert torch.allclose(out, torch.tensor([2.0, 1.0 - 1.0, 0.5 - 0.5, 0.25]))


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    out = _processed(logits, _row(repetition_penalty=2.0, prompt_ids=[0], output_ids=[1]))
    assert torch.allclose(out, torch.tensor([1.0, -2.0, 0.5, 3.0]))


def test_min_p_drops_unlikely_tokens() -> None:
    # probabilities about 0.64, 0.24, 0.09, 0.03: min_p 0.2 keeps tokens 0 and 1 only
    logits = torch.log(torch.tensor([[0.64, 0.24, 0.09, 0.03]]))
    draws = {
        sample(logits, [RowSampling(SamplingParams(min_p=0.2), torch.Generator().manual_seed(s))])[0].item()
        for s in range(300)
    }
    assert draws == {0, 1}
    free = {
        sample(logits, [RowSampling(SamplingParams(), torch.Generator().manual_seed(s))])[0].item()
        for s in range(300)
    }
    assert free == {0, 1, 2, 3}


def test_processors_are_per_row() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0], [5.0, 4.0, 1.0]])
    tokens, raw = sample(logits, [_row(temperature=0, logit_bias={0: -100.0}), _row(temperature=0)])
    assert tokens.tolist() == [1, 0]
    # log-probabilities stay those of the raw model distribution
    assert torch.allclose(raw[0], raw[1])


def test_sampling_param_validation() -> None:
    for kw, param in (
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {1: 101.0}}, "logit_bias"),
    ):
        with pytest.raises(InvalidParams) as err:
            SamplingParams(**kw).validate()  # type: ignore[arg-type]
        assert err.value.param == param
    SamplingParams(seed=2**64 - 1).validate()
    with pytest.raises(InvalidParams) as err:
        SamplingParams(stop_token_ids=[10**6]).check_vocab(49152)
    assert err.value.param == "stop_token_ids"


@pytest.mark.e2e
def test_smollm2_constrained_outputs_validate() -> None:
    from tests.helpers.models import smollm2_dir

    engine = TorchEngine.from_pretrained(smollm2_dir(), max_batch_size=8)
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "city": {"type": "string", "maxLength": 40},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
    prompts = [
        engine.encode_chat([{"role": "user", "content": q}])
        for q in ("Describe a person as JSON with name, age and city.", "Invent a character.")
    ]
    guided = GuidedDecoding(json_schema=json.dumps(schema))
    for seed in (1, 2):
        outs = engine.generate_batch(
            prompts, SamplingParams(temperature=1.0, max_tokens=120, seed=seed, n=4, guided=guided)
        )
        for out in outs:
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), schema)
    obj = engine.generate_batch(
        prompts,
        SamplingParams(
            temperature=1.0,
            max_tokens=300,
            seed=3,
            n=3,
            guided=GuidedDecoding(json_schema='{"type": "object"}'),
        ),
    )
    for out in obj:
        assert out.finish_reason == "stop", out.text
        assert isinstance(json.loads(out.text), dict)
    # a forced tool call on the real model: always parses, arguments validate
    prompt = engine.encode_chat([{"role": "user", "content": "What is 12 plus 30?"}], TOOLS)
    guided = GuidedDecoding(json_schema=json.dumps(call_schema(TOOLS, None, True)), param="tools")
    for out in engine.generate_batch(
        [prompt], SamplingParams(temperature=1.0, max_tokens=200, seed=4, n=4, guided=guided)
    ):
        calls = parse_tool_calls(out.text, TOOLS)
        assert out.finish_reason == "stop" and calls, out.text
        for call in calls:
            schema = TOOLS[0 if call.function.name == "add" else 1]["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), schema)


def test_long_prompt_with_several_choices_prefills_in_padded_chunks(engine: TorchEngine) -> None:
    """Chunks of different lengths share a padded prefill: a short chunk far into its prompt
    must not make the step read keys beyond the cache (it once failed every choice)."""
    # this prompt's 6 choices once failed: chunks (72 at 184-token offset) + (144 from 0) padded
    prompt = engine.encode_chat([{"role": "user", "content": "What is 2 + 3?"}], TOOLS)
    engine.generate_batch(
        [_chat(engine, "hi")], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )
    ref = engine.model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[
        0, len(prompt) :
    ].tolist()
    outs = engine.generate_batch([prompt], SamplingParams(temperature=0, max_tokens=6, n=6, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length"] * 6
    assert all(o.token_ids == ref for o in outs)


def test_suffix_builds_a_fill_in_the_middle_prompt(tiny_model_path: Path) -> None:
    """With FIM tokens in the vocabulary, suffix makes a prefix-suffix-middle prompt; without, 400."""
    import asyncio

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.inference.engine.types import EngineRequest

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    plain = TorchEngine.from_model(model, tok)
    with pytest.raises(InvalidParams) as err:
        plain.prompt_ids(EngineRequest("r", SamplingParams(), prompt="def f(", suffix="return x"))
    assert err.value.param == "suffix"
    tok.add_special_tokens({"additional_special_tokens": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]})
    model.resize_token_embeddings(len(tok))
    engine = TorchEngine.from_model(model, tok)
    ids = engine.prompt_ids(EngineRequest("r", SamplingParams(), prompt="def f(", suffix="return x"))
    pre, suf, mid = tok.convert_tokens_to_ids(["<fim_prefix>", "<fim_suffix>", "<fim_middle>"])
    assert ids[-1] == mid and pre in ids and suf in ids
    assert ids.index(pre) < ids.index(suf)
    assert tok.decode(ids[ids.index(pre) + 1 : ids.index(suf)]) == "def f("

    async def run() -> str:
        req = EngineRequest(
            "r", SamplingParams(temperature=0, max_tokens=4), prompt="def f(", suffix="return x"
        )
        return "".join([ev.text async for ev in await engine.generate(req)])

    engine.scheduler.start()
    try:
        assert isinstance(asyncio.run(run()), str)
    finally:
        engine.scheduler.stop()


def test_forced_call_arguments_are_closed_unless_the_function_allows_more() -> None:
    """A forced call's arguments may not carry keys outside the function's properties (SmolLM2
    copied schema keywords in as arguments), unless the function's schema allows them."""
    open_fn = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    }
    loose = {"type": "object", "properties": {}, "additionalProperties": True}
    free_fn = {"type": "function", "function": {"name": "g", "parameters": loose}}
    schema = call_schema([open_fn, free_fn], None, parallel=False)
    f_args, g_args = (v["properties"]["arguments"] for v in schema["anyOf"])
    assert f_args["additionalProperties"] is False and f_args["properties"] == {"x": {"type": "integer"}}
    assert g_args == loose
    assert "additionalProperties" not in open_fn["function"]["parameters"]  # the request is not changed
