"""Layers with a sliding attention window (Gemma 3's local layers, Mistral's every layer) on the
lean forwards' C++ and Python loops and on the Hugging Face modules: a tiny random-initialised
model whose window (8) is shorter than prompt and answer, checked against transformers' own
modelling of it (greedy tokens equal to ``generate``'s, each logit within 1e-4 of transformers'
relative to the largest, as in ``test_architectures.py``), alone and in a batch of prompts of
different lengths, with the model's whole context served."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from services.inference.engine import TorchEngine, native, quantized_linear
from services.inference.engine.layer_ops import layer_ops
from services.inference.engine.plan import plan_for
from services.inference.engine.ragged import DecodeRow, PrefillRow
from tests.inference.test_architectures import _build as build
from tests.inference.test_architectures import _config, _relative

pytestmark = pytest.mark.skipif(
    quantized_linear.available("int4", torch.device("cpu")) is not None or not native.avx2(),
    reason="needs torch's CPU int4 kernel and an AVX2 CPU",
)

WINDOW = 8
# prompts of different lengths, each longer than the window
PROMPTS = [list(range(300 + 11 * i, 300 + 11 * i + n)) for i, n in enumerate((20, 13, 24, 10))]
NEW_TOKENS = 12


def _build(arch: str, vocab: int, window: int) -> Any:
    """``test_architectures``' model of ``arch`` with a sliding window of ``window`` (Gemma 3: its
    first layer local, the second global; Mistral: every layer)."""
    config = _config(arch, vocab)
    config.sliding_window = window
    return build(arch, vocab, config=config)


def _generate(model: Any, prompt: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
    )
    return [int(t) for t in out[0, len(prompt) :]]


def _greedy(engine: TorchEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of ``prompts`` decoded together, one slot each (the prompts in one step, then
    one decode token of each a step)."""
    runner = engine.runner
    logits = runner.forward([], [PrefillRow(slot=s, token_ids=p, start=0) for s, p in enumerate(prompts)])
    out: list[list[int]] = [[int(t)] for t in logits.argmax(-1)]
    for step in range(NEW_TOKENS - 1):
        rows = [DecodeRow(slot=s, token=out[s][-1], position=len(p) + step) for s, p in enumerate(prompts)]
        for s, t in enumerate(runner.forward(rows, []).argmax(-1)):
            out[s].append(int(t))
    return out


def _logit_error(engine: TorchEngine, model: Any, tokens: list[int]) -> float:
    """The largest relative error of the engine's logits (a prompt of the first 14 tokens in two
    chunks, the others decode tokens) against transformers' forward over ``tokens``."""
    runner = engine.runner
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0]
    got = [runner.forward([], [PrefillRow(slot=0, token_ids=tokens[:9], start=0)])[0]]
    got.append(runner.forward([], [PrefillRow(slot=0, token_ids=tokens[9:14], start=9)])[0])
    positions = [8, 13]
    for position in range(14, len(tokens)):
        got.append(runner.forward([DecodeRow(slot=0, token=tokens[position], position=position)], [])[0])
        positions.append(position)
    return max(_relative(g, ref[p]) for g, p in zip(got, positions, strict=True))


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_windowed_layers_equal_transformers_past_the_window(arch: str, tokenizer: Any) -> None:
    model = _build(arch, len(tokenizer), WINDOW)
    ops = layer_ops(model.config, model.model.layers)
    assert not isinstance(ops, str)
    assert ops.window == ((WINDOW, None) if arch == "gemma3" else (WINDOW, WINDOW))
    expected = [_generate(model, p) for p in PROMPTS]
    assert len(set(expected[0])) > 2, "a degenerate model tests nothing"
    # the window changes what the model says: full attention would not pass this test
    full = _build(arch, len(tokenizer), 4096)
    assert [_generate(full, p) for p in PROMPTS] != expected
    native_plan = plan_for(model, quantize="none", native_decode="on")
    assert native_plan.decode == "native-own", native_plan.reasons
    plan = plan_for(model, quantize="none", native_decode="off")
    assert (plan.decode, plan.prompt) == ("python", "python"), plan.reasons
    assert "sliding window of 8" in plan.reasons["family"]
    reference = dataclasses.replace(plan, decode="reference", prompt="reference")
    for paths in (native_plan, plan, reference):
        engine = TorchEngine.from_model(model, tokenizer, max_batch_size=len(PROMPTS), plan=paths)
        assert engine.runner.max_len > max(map(len, PROMPTS)) + NEW_TOKENS, "the context is not capped"
        alone = [_greedy(engine, [p])[0] for p in PROMPTS]
        assert alone == expected, paths.decode
        assert _greedy(engine, PROMPTS) == alone, paths.decode
        tokens = PROMPTS[2] + expected[2]
        assert _logit_error(engine, model, tokens) < 1e-4, paths.decode


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_the_cpp_prompt_layers_attend_the_window(arch: str, tokenizer: Any) -> None:
    """The C++ prompt layers (bf16 block products) give the prompt logits of the Python loop over
    the same products, chunks of different lengths in one step, and a windowed layer's keys past
    its window change them (full attention would not pass)."""
    model = _build(arch, len(tokenizer), WINDOW)
    plan = plan_for(model, quantize="none", prompt_dtype="bfloat16", native_decode="on")
    assert plan.prompt == "native", plan.reasons
    chunks = [PrefillRow(slot=s, token_ids=p, start=0) for s, p in enumerate(PROMPTS)]
    got = {}
    for path in ("native", "python"):
        engine = TorchEngine.from_model(
            model, tokenizer, max_batch_size=len(PROMPTS), plan=dataclasses.replace(plan, prompt=path)
        )
        got[path] = engine.runner.forward([], chunks)
    unwindowed = _build(arch, len(tokenizer), 4096)  # the same weights, full attention
    with torch.no_grad():
        expected = [model(torch.tensor([p])).logits[0, -1] for p in PROMPTS]
        full = [unwindowed(torch.tensor([p])).logits[0, -1] for p in PROMPTS]
    assert max(_relative(f, e) for f, e in zip(full, expected, strict=True)) > 0.1
    for ours, python, ref in zip(got["native"], got["python"], expected, strict=True):
        assert _relative(ours, python) < 1e-2
        assert _relative(ours, ref) < 5e-2  # bf16 products against the fp32 model


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)
