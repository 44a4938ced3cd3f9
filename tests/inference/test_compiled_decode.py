"""``torch.compile`` of the decode step (a plan with ``decode="compiled"``): greedy output equals
the eager engine's (one request, several sharing a batch, a grammar-constrained one, fp32 and int4
products), compiling happens at start-up and serving compiles nothing more, steps with a LoRA
adapter run eagerly with the same tokens, and the setting reaches the server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from services.inference.config import InferenceSettings
from services.inference.engine import SamplingParams, TorchEngine, quantized_linear
from services.inference.engine.compiled_decode import CompiledDecode
from services.inference.engine.plan import plan_for
from services.inference.engine.types import EngineRequest, GuidedDecoding
from tests.helpers.models import make_lora_adapter, make_tiny_llama

pytestmark = pytest.mark.skipif(
    quantized_linear.available("int4", torch.device("cpu")) is not None,
    reason="this torch build has no CPU weight-only int4 kernel",
)

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three fruits.", "hi"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _load(path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def _chat(tok: Any, q: str) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _cache_entries() -> int:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(CompiledDecode._step.__code__))


def _compiled(engine: TorchEngine) -> CompiledDecode:
    assert engine.runner.compiled is not None
    return engine.runner.compiled


def _count_compiled_steps(engine: TorchEngine) -> list[int]:
    """Counts the forwards that ran compiled (a wrapper around the compiled callable)."""
    compiled = _compiled(engine)
    counter = [0]
    inner = compiled._compiled

    def counting(*args: Any) -> torch.Tensor:
        counter[0] += 1
        return inner(*args)

    compiled._compiled = counting
    return counter


async def _serve(
    engine: TorchEngine, requests: list[tuple[list[int], SamplingParams, str | None]]
) -> list[list[int]]:
    async def one(i: int, prompt: list[int], params: SamplingParams, model: str | None) -> list[int]:
        stream = await engine.generate(
            EngineRequest(request_id=f"r{i}", params=params, model=model, prompt_token_ids=prompt)
        )
        return [t for ev in [ev async for ev in stream] for t in ev.token_ids]

    return list(await asyncio.gather(*(one(i, *r) for i, r in enumerate(requests))))


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_compiled_greedy_equals_eager_alone_in_a_batch_and_constrained(
    lively_tiny_path: Path, quantize: str
) -> None:
    model, tok = _load(lively_tiny_path)
    eager = TorchEngine.from_model(model, tok, max_batch_size=4, prefill_chunk=32, quantize=quantize)  # type: ignore[arg-type]
    compiled = TorchEngine.from_model(
        model,
        tok,
        max_batch_size=4,
        prefill_chunk=32,
        plan=plan_for(model, quantize=quantize, decode="compiled"),  # type: ignore[arg-type]
    )
    prompts = [_chat(tok, q) for q in QUESTIONS] + [list(range(300, 340)), list(range(900, 917))]
    guided = SamplingParams(
        temperature=0, max_tokens=24, guided=GuidedDecoding(json_schema=json.dumps(SCHEMA))
    )

    async def run() -> tuple[list[list[int]], list[list[int]]]:
        await compiled.start()  # compiles both graphs before serving
        assert set(_compiled(compiled).compile_seconds) == {"1 row", "2..4 rows"}
        entries = _cache_entries()
        counter = _count_compiled_steps(compiled)
        try:
            alone = await _serve(compiled, [(prompts[0], GREEDY, None)])
            # six requests in four slots (they join as others leave), one of them constrained to JSON
            batch = await _serve(
                compiled, [(p, GREEDY, None) for p in prompts] + [(prompts[1], guided, None)]
            )
        finally:
            await compiled.shutdown()
        assert counter[0] > 20, "decode steps should have run compiled"
        assert _cache_entries() == entries, "serving should not compile again"
        return alone, batch

    alone, batch = asyncio.run(run())
    reference = eager.generate_batch(prompts, GREEDY)
    assert alone[0] == reference[0].token_ids
    assert batch[: len(prompts)] == [o.token_ids for o in reference]
    assert len({tuple(t) for t in batch[: len(prompts)]}) == len(prompts), "outputs should differ per prompt"
    constrained = eager.generate_batch([prompts[1]], guided)[0]
    assert batch[-1] == constrained.token_ids
    assert tok.decode(batch[-1]).startswith("{")  # JSON, cut at max_tokens


def test_lora_steps_run_eagerly_with_the_same_tokens(lively_tiny_path: Path, tmp_path: Path) -> None:
    adapter = make_lora_adapter(lively_tiny_path, tmp_path / "lora", seed=3)
    model, tok = _load(lively_tiny_path)
    engine = TorchEngine.from_model(
        model, tok, max_batch_size=2, plan=plan_for(model, quantize="int4", decode="compiled")
    )
    counter = _count_compiled_steps(engine)
    prompt = _chat(tok, QUESTIONS[1])
    before = engine.generate_batch([prompt], GREEDY)[0].token_ids  # compiles lazily, then runs compiled
    assert counter[0] > 0
    engine.load_adapter_sync("a", str(adapter))
    ran = counter[0]
    both = asyncio.run(_run_started(engine, [(prompt, GREEDY, "a"), (prompt, GREEDY, None)]))
    assert counter[0] == ran, "with LoRA layers in the model every step runs eagerly"

    reference_model, _ = _load(lively_tiny_path)
    reference = TorchEngine.from_model(reference_model, tok, max_batch_size=2, quantize="int4")
    reference.load_adapter_sync("a", str(adapter))
    expected = asyncio.run(_run_started(reference, [(prompt, GREEDY, "a"), (prompt, GREEDY, None)]))
    assert both == expected
    assert both[1] == before and both[0] != before


async def _run_started(
    engine: TorchEngine, requests: list[tuple[list[int], SamplingParams, str | None]]
) -> list[list[int]]:
    engine.scheduler.start()
    try:
        return await _serve(engine, requests)
    finally:
        await engine.shutdown()


def test_compiled_decode_is_a_plan_made_by_hand() -> None:
    # no setting selects it (TANDEM_INFERENCE_COMPILE is refused as unknown): a plan does
    assert "compile" not in InferenceSettings.model_fields
    with pytest.raises(ValidationError, match="forward"):
        InferenceSettings(forward="compiled")  # type: ignore[arg-type]


def test_batch_sizes_and_a_growing_cache_compile_nothing_more(tmp_path: Path) -> None:
    from services.inference.engine.ragged import DecodeRow, PrefillRow

    # three key/value heads, as SmolLM2: the warm-up attends 3 keys, and with dynamo's duck
    # sizing both sizes became one symbol, so every later step compiled again
    model, tok = _load(make_tiny_llama(tmp_path / "kv3", hidden=96, heads=6, kv_heads=3))
    engine = TorchEngine.from_model(
        model, tok, max_batch_size=4, plan=plan_for(model, quantize="int4", decode="compiled")
    )
    eager = TorchEngine.from_model(model, tok, max_batch_size=4, quantize="int4")
    _compiled(engine).warm_up()
    entries = _cache_entries()
    for runner in (engine.runner, eager.runner):
        for slot in range(4):
            runner.forward([], [PrefillRow(slot=slot, token_ids=list(range(100 + slot, 140)), start=0)])
    capacity = engine.runner.cache.capacity
    # every batch size up to the slots, then positions past the slab's capacity (it grows)
    for rows, position in ((4, 40), (3, 41), (1, 42), (2, capacity + 5), (4, capacity + 6)):
        decode = [DecodeRow(slot=s, token=7 + s, position=position) for s in range(rows)]
        got, want = engine.runner.forward(decode, []), eager.runner.forward(decode, [])
        # logits within bf16 rounding (the head multiplies in bf16, and inductor's fused norms
        # may round an activation's last bit differently)
        assert float((got - want).abs().max()) < 0.5
    assert engine.runner.cache.capacity > capacity
    assert _cache_entries() == entries, "no batch size, attended length or cache growth should compile again"
