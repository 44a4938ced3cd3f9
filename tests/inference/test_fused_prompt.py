"""The lean prompt forward (``engine/fused_prompt.py``): the eager forward's logits and keys/values
(bit for bit where the CPU's side-by-side products give the separate products' bits, else within
bf16 rounding), each prompt token's numbers independent of what shares its forward, LoRA rows,
weights changed in place, and the eager forward wherever it does not apply."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from services.inference.engine import TorchEngine, fused_prompt, packed_linear, quantized_linear
from services.inference.engine.fused_prompt import FusedPrompt
from services.inference.engine.packed_linear import OneDNNPacked
from services.inference.engine.plan import ModelFacts, plan_for
from services.inference.engine.quantized_linear import BlockedBF16, TwoSides
from services.inference.engine.ragged import DecodeRow, PrefillRow
from tests.helpers.models import make_lora_adapter

ONEDNN_BF16 = packed_linear.available(torch.device("cpu"), torch.bfloat16)
# the prompt dtypes this CPU multiplies in (bf16 only where oneDNN has bf16 products)
PROMPT_DTYPES = ["float32", "bfloat16"] if ONEDNN_BF16 else ["float32"]
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _load(path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def _engine(path: Path, prompt_dtype: str, lean: bool, adapter: Path | None = None) -> TorchEngine:
    model, tok = _load(path)
    quantize = "int4" if quantized_linear.available("int4", torch.device("cpu")) is None else "none"
    plan = plan_for(model, quantize=quantize, prompt_dtype=prompt_dtype)  # type: ignore[arg-type]
    if not lean:
        plan = dataclasses.replace(plan, prompt="reference")
    engine = TorchEngine.from_model(model, tok, max_batch_size=8, plan=plan)
    if adapter is not None:
        engine.load_adapter_sync("a", str(adapter))
    engine.runner.prepare_weights()
    assert (engine.runner.fused_prompt is not None) == lean
    return engine


def _side_by_side_exact(kernel: Any, sizes: list[tuple[int, int]]) -> bool:
    """Whether ``kernel``'s product of weights stacked by output rows gives each weight's own
    product bit for bit on this CPU (then the lean forward is the eager one bit for bit)."""
    gen = torch.Generator().manual_seed(3)
    for out_features, in_features in sizes:
        weights = [torch.randn(out_features, in_features, generator=gen) for _ in range(3)]
        x = torch.randn(70, in_features, generator=gen)
        apart = torch.cat([kernel.apply(x, kernel.prepare(w), None) for w in weights], dim=1)
        if not torch.equal(apart, kernel.apply(x, kernel.prepare(torch.cat(weights)), None)):
            return False
    return True


def _kernel(prompt_dtype: str) -> Any:
    return BlockedBF16() if prompt_dtype == "bfloat16" else OneDNNPacked()


def _steps(adapter: str | None) -> list[tuple[list[DecodeRow], list[PrefillRow]]]:
    prompts = [list(range(300 + 7 * s, 331 + 5 * s)) for s in range(6)]

    def chunk(s: int, start: int = 0, end: int | None = None) -> PrefillRow:
        return PrefillRow(
            slot=s, token_ids=prompts[s][start:end], start=start, adapter=adapter if s % 2 else None
        )

    return [
        ([], [chunk(0)]),  # one prompt alone
        ([], [chunk(1), chunk(2), chunk(3, 0, 20)]),  # several, and the first part of one
        ([], [chunk(3, 20)]),  # the rest of it, after its cached part
        # prompt chunks beside decode tokens
        ([DecodeRow(slot=0, token=9, position=len(prompts[0]))], [chunk(4), chunk(5, 0, 1)]),
    ]


def _assert_alike(eager: TorchEngine, lean: TorchEngine, adapter: str | None, exact: bool) -> None:
    calls = []
    original = FusedPrompt.__call__

    def counting(self: FusedPrompt, plan: Any, lora: Any = None) -> torch.Tensor:
        calls.append(len(plan.prefill_slots))
        return original(self, plan, lora)

    FusedPrompt.__call__ = counting  # type: ignore[method-assign]
    try:
        for decode, prefill in _steps(adapter):
            ref = eager.runner.forward(decode, prefill)
            out = lean.runner.forward(decode, prefill)
            if exact:
                assert torch.equal(ref, out), (prefill, float((ref - out).abs().max()))
            else:  # the last bits of bf16 products: within rounding, the same greedy token
                assert float((ref - out).norm() / ref.norm()) < 1e-2
                assert torch.equal(ref.argmax(-1), out.argmax(-1))
    finally:
        FusedPrompt.__call__ = original  # type: ignore[method-assign]
    # every step's prompt chunks took the lean forward, all of them and only them
    assert calls == [1, 3, 1, 2]
    for ref_store, store in zip(
        eager.runner.cache.k + eager.runner.cache.v, lean.runner.cache.k + lean.runner.cache.v, strict=True
    ):
        if exact:
            assert torch.equal(ref_store[:6], store[:6])
        else:
            assert torch.allclose(ref_store[:6], store[:6], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("prompt_dtype", PROMPT_DTYPES)
def test_the_lean_prompt_forward_gives_the_eager_forwards_numbers(
    lively_tiny_path: Path, prompt_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bf16 products in blocks of 64 rows in both: larger blocks are chosen per weight (the eager
    # forward's separate k/v weights may get other blocks than q/k/v side by side)
    monkeypatch.setattr(quantized_linear, "PROMPT_BLOCK_MAX", quantized_linear.PROMPT_BLOCK)
    eager = _engine(lively_tiny_path, prompt_dtype, lean=False)
    lean = _engine(lively_tiny_path, prompt_dtype, lean=True)
    hidden, inner = eager.runner.config.hidden_size, eager.runner.config.intermediate_size
    exact = _side_by_side_exact(_kernel(prompt_dtype), [(hidden, hidden), (inner, hidden)])
    _assert_alike(eager, lean, None, exact)
    # one copy of each projection's prompt weight: the lean forward's (side by side); the
    # layers' own prompt sides are never made
    runner = lean.runner
    assert runner.packed is not None and runner.fused_prompt is not None
    multiplied = runner.fused_prompt.multiplied()
    assert len(multiplied) == 7 * len(runner.decoder.layers)
    for packed in runner.packed.layers:
        if isinstance(packed.weight, TwoSides):
            assert (packed.weight.prompt is None) == (id(packed.module) in multiplied), packed.module
    kinds = {type(p.kernel) for layer in runner.fused_prompt.layers for p in layer.products()}
    assert kinds == {type(_kernel(prompt_dtype))}


@pytest.mark.parametrize("prompt_dtype", PROMPT_DTYPES)
def test_a_prompt_tokens_numbers_do_not_depend_on_what_shares_its_forward(
    lively_tiny_path: Path, prompt_dtype: str
) -> None:
    engine = _engine(lively_tiny_path, prompt_dtype, lean=True)
    runner = engine.runner
    prompt = list(range(1000, 1037))
    alone = runner.forward([], [PrefillRow(slot=0, token_ids=prompt, start=0)])
    keys = [k[0, :, : len(prompt)].clone() for k in runner.cache.k]
    # the same prompt among others (more than one 64-row block in all), at another slot and place
    others = [PrefillRow(slot=s, token_ids=list(range(50 * s, 50 * s + 29)), start=0) for s in range(1, 4)]
    rows = [others[0], PrefillRow(slot=5, token_ids=prompt, start=0), *others[1:]]
    among = runner.forward([], rows)
    assert torch.equal(among[1], alone[0])
    assert all(torch.equal(k[5, :, : len(prompt)], ref) for k, ref in zip(runner.cache.k, keys, strict=True))
    # a prompt in two chunks (its first part cached) ends with the same logits as in one
    runner.forward([], [PrefillRow(slot=6, token_ids=prompt[:30], start=0)])
    rest = runner.forward([], [PrefillRow(slot=6, token_ids=prompt[30:], start=30), others[0]])
    assert torch.equal(rest[0], alone[0])


def test_lora_rows_in_prompt_chunks(lively_tiny_path: Path, tmp_path: Path) -> None:
    adapter = make_lora_adapter(lively_tiny_path, tmp_path / "lora", seed=7, modules=ALL_PROJECTIONS)
    dtype = PROMPT_DTYPES[-1]
    eager = _engine(lively_tiny_path, dtype, lean=False, adapter=adapter)
    lean = _engine(lively_tiny_path, dtype, lean=True, adapter=adapter)
    assert lean.runner.fused_prompt is not None and lean.runner.fused_prompt.lora_problem is None
    # each adapter's modules on a product as one stacked pair of products: PEFT's deltas within
    # rounding (the scaling multiplies B, not the delta)
    _assert_alike(eager, lean, "a", exact=False)
    runner = lean.runner
    prompt = list(range(700, 730))
    alone = runner.forward([], [PrefillRow(slot=7, token_ids=prompt, start=0, adapter="a")])
    # the adapter changes its rows (the comparison above is not of two base models)
    base = runner.forward([], [PrefillRow(slot=6, token_ids=prompt, start=0)])
    assert float((alone - base).norm()) > 1.0
    # an adapter's prompt gets the same numbers among base and adapter prompts as alone
    others = [
        PrefillRow(
            slot=s, token_ids=list(range(40 * s, 40 * s + 50)), start=0, adapter="a" if s % 2 else None
        )
        for s in range(3)
    ]
    among = runner.forward(
        [], [others[0], PrefillRow(slot=5, token_ids=prompt, start=0, adapter="a"), *others[1:]]
    )
    assert torch.equal(among[1], alone[0])
    # an adapter whose weights change in place (the trainer) is stacked again
    layer = runner.decoder.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B["a"].weight.mul_(3.0)
    again = runner.forward([], [PrefillRow(slot=4, token_ids=prompt, start=0, adapter="a")])
    assert float((again - alone).abs().max()) > 1e-3


def test_a_weight_changed_in_place_is_multiplied_as_it_is_now(lively_tiny_path: Path) -> None:
    # the trainer's in-process engine: an optimizer step changes the weights between rollouts
    engines = [_engine(lively_tiny_path, PROMPT_DTYPES[-1], lean=lean) for lean in (False, True)]
    prompt = list(range(300, 340))
    before = [e.runner.forward([], [PrefillRow(slot=0, token_ids=prompt, start=0)]) for e in engines]
    for engine in engines:
        with torch.no_grad():
            engine.runner.decoder.layers[1].mlp.up_proj.weight.mul_(-2.0)
            engine.runner.decoder.layers[0].self_attn.v_proj.weight.add_(0.05)
    after = [e.runner.forward([], [PrefillRow(slot=1, token_ids=prompt, start=0)]) for e in engines]
    assert float((after[1] - before[1]).abs().max()) > 1e-2
    assert float((after[0] - after[1]).norm() / after[0].norm()) < 1e-2


def test_prompt_chunks_take_the_eager_forward_where_the_lean_one_does_not_apply(
    lively_tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peft import LoraConfig, get_peft_model

    model, tok = _load(lively_tiny_path)
    # plain torch products: no prepared prompt kernel to multiply side by side
    plain = plan_for(model, forward="reference")
    assert (plain.layer_prompt, plain.prompt) == ("torch", "reference")
    runner = TorchEngine.from_model(model, tok, plan=dataclasses.replace(plain, forward="auto")).runner
    assert runner.fused_prompt is None
    facts = ModelFacts.of(model)
    assert fused_prompt.unsupported(facts.ops, facts.device, runner.plan.layer_prompt) is not None
    with pytest.raises(ValueError, match="prompt='python'"):
        TorchEngine.from_model(model, tok, plan=dataclasses.replace(plain, prompt="python"))
    eager = TorchEngine.from_model(model, tok, plan=plan_for(model, prompt="reference"))
    assert eager.runner.fused_prompt is None
    # a model type whose layers are not Llama's
    monkeypatch.setattr(model.config, "model_type", "gpt2")
    facts = ModelFacts.of(model)
    layer_prompt = TorchEngine.from_model(model, tok).plan.layer_prompt
    assert "gpt2" in str(fused_prompt.unsupported(facts.ops, facts.device, layer_prompt))
    monkeypatch.undo()
    # a PEFT model whose adapter is not routed per row (the trainer's in-process engine): its
    # prompts keep the eager forward, which applies the model's active adapter
    peft_model = get_peft_model(_load(lively_tiny_path)[0], LoraConfig(r=4, target_modules=["q_proj"]))
    trainer = TorchEngine.from_model(peft_model, tok, quantize="int4").runner
    assert trainer.fused_prompt is not None
    assert trainer.fused_prompt.lora_problem == "the model's adapters are not routed per row"
    calls = []
    monkeypatch.setattr(FusedPrompt, "__call__", lambda *a: calls.append(a))
    trainer.forward([], [PrefillRow(slot=0, token_ids=list(range(10, 30)), start=0)])
    assert calls == []
