"""The lean decode forward (``engine/fused_decode.py``): the eager forward's logits and keys/values
bit for bit (decode steps of one and several rows, slots out of order, a step shared with a
prompt chunk, LoRA rows beside base rows), and the eager forward wherever it does not apply."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.platforms import cpu_features
from services.inference.engine import TorchEngine, fused_decode, native, quantized_linear
from services.inference.engine.plan import ModelFacts, plain_head, plan_for
from services.inference.engine.ragged import DecodeRow, PrefillRow
from services.inference.engine.types import AdapterError
from tests.helpers.models import make_lora_adapter

pytestmark = pytest.mark.skipif(
    quantized_linear.available("int4", torch.device("cpu")) is not None,
    reason="this torch build has no CPU weight-only int4 kernel",
)


def _load(path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def _engines(path: Path, adapter: Path | None = None) -> tuple[TorchEngine, TorchEngine]:
    engines = []
    for fused in (False, True):
        model, tok = _load(path)
        # prompt chunks through the eager forward in both (test_fused_prompt.py has the lean one);
        # the lean forward's Python loop: the eager forward's numbers bit for bit (the C++ loop's
        # are test_native_own.py's)
        plan = plan_for(
            model,
            quantize="int4",
            native_decode="off",
            decode="python" if fused else "reference",
            prompt="reference",
            head_decode=plain_head(),
        )
        engine = TorchEngine.from_model(model, tok, max_batch_size=6, plan=plan)
        if adapter is not None:
            engine.load_adapter_sync("a", str(adapter))
        engines.append(engine)
    eager, lean = engines
    assert eager.runner.fused is None and lean.runner.fused is not None
    return eager, lean


def _steps(adapter: str | None) -> list[tuple[list[DecodeRow], list[PrefillRow]]]:
    prompts = [list(range(300 + 7 * s, 330 + 5 * s)) for s in range(5)]
    steps: list[tuple[list[DecodeRow], list[PrefillRow]]] = [
        ([], [PrefillRow(slot=s, token_ids=p, start=0, adapter=adapter if s % 2 else None)])
        for s, p in enumerate(prompts[:4])
    ]
    position = [len(p) for p in prompts]
    for i in range(3):
        rows = [DecodeRow(slot=s, token=400 + 11 * s + i, position=position[s] + i) for s in range(4)]
        for row in rows:
            row.adapter = adapter if row.slot % 2 else None
        steps.append((rows, []))
    # one row alone, rows out of slot order, and decode tokens beside a prompt chunk
    steps.append(([DecodeRow(slot=2, token=5, position=position[2] + 3)], []))
    steps.append(
        (
            [
                DecodeRow(slot=3, token=9, position=position[3] + 3, adapter=adapter),
                DecodeRow(slot=0, token=8, position=position[0] + 3),
            ],
            [],
        )
    )
    steps.append(
        (
            [DecodeRow(slot=1, token=6, position=position[1] + 3, adapter=adapter)],
            [PrefillRow(slot=4, token_ids=prompts[4], start=0)],
        )
    )
    return steps


def _assert_same_steps(eager: TorchEngine, lean: TorchEngine, adapter: str | None) -> None:
    calls = []
    original = fused_decode.FusedDecode.__call__

    def counting(self: fused_decode.FusedDecode, plan: Any, lora: Any = None) -> torch.Tensor:
        calls.append(plan.n_decode)
        return original(self, plan, lora)

    fused_decode.FusedDecode.__call__ = counting  # type: ignore[method-assign]
    try:
        for decode, prefill in _steps(adapter):
            ref = eager.runner.forward(decode, prefill)
            out = lean.runner.forward(decode, prefill)
            assert torch.equal(ref, out), (decode, prefill, float((ref - out).abs().max()))
    finally:
        fused_decode.FusedDecode.__call__ = original  # type: ignore[method-assign]
    # every step with decode tokens took the lean forward, and only their tokens
    assert calls == [4, 4, 4, 1, 2, 1]
    for ref_store, store in zip(
        eager.runner.cache.k + eager.runner.cache.v, lean.runner.cache.k + lean.runner.cache.v, strict=True
    ):
        assert torch.equal(ref_store[:5], store[:5])


def test_the_lean_forward_gives_the_eager_forwards_numbers_bit_for_bit(lively_tiny_path: Path) -> None:
    eager, lean = _engines(lively_tiny_path)
    for engine in (eager, lean):
        engine.runner.prepare_weights()
    _assert_same_steps(eager, lean, None)
    # one int4 copy of each projection: the lean forward's; the layers' own decode sides are
    # never made (the output head, which the lean forward calls as a module, keeps its own)
    assert lean.runner.packed is not None and lean.runner.fused is not None
    multiplied = lean.runner.fused.multiplied()
    sides = {id(p.module) in multiplied: p.weight.decode is None for p in lean.runner.packed.layers}
    assert len(multiplied) == 7 * len(lean.runner.decoder.layers)
    assert sides == {True: True, False: False}
    assert eager.runner.packed is not None
    assert all(p.weight.decode is not None for p in eager.runner.packed.layers)


def test_a_weight_changed_in_place_is_multiplied_as_it_is_now(lively_tiny_path: Path) -> None:
    # the trainer's in-process engine: an optimizer step changes the weights between rollouts
    eager, lean = _engines(lively_tiny_path)
    prompt = list(range(300, 320))
    before = []
    for engine in (eager, lean):
        engine.runner.forward([], [PrefillRow(slot=0, token_ids=prompt, start=0)])
        before.append(engine.runner.forward([DecodeRow(slot=0, token=7, position=len(prompt))], []))
    assert torch.equal(before[0], before[1])
    for engine in (eager, lean):
        with torch.no_grad():
            engine.runner.decoder.layers[1].mlp.down_proj.weight.mul_(-2.0)
            engine.runner.decoder.layers[0].self_attn.k_proj.weight.add_(0.05)
    after = [e.runner.forward([DecodeRow(slot=0, token=7, position=len(prompt))], []) for e in (eager, lean)]
    assert torch.equal(after[0], after[1])
    assert float((after[1] - before[1]).abs().max()) > 1e-3


def test_a_native_loop_that_cannot_be_built_names_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_BUILD", native._Build())
    monkeypatch.setattr(native.shutil, "which", lambda _name: None)
    with pytest.raises(native.NativeBuildError, match="no C\\+\\+ compiler"):
        native.start("on")
    # auto: serving goes on with the Python loop, the reason kept (and not tried again)
    assert not native.start("auto")
    assert native.decode_own() is None and native.prompt_own() is None and native.q8_linear() is None
    assert native.problem() is not None and "no C++ compiler" in native.problem()
    assert not native.start("auto")


def test_an_engine_whose_native_build_failed_keeps_the_python_loop_and_the_bf16_head(
    lively_tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native, "_BUILD", native._Build())
    monkeypatch.setattr(native.shutil, "which", lambda _name: None)
    model, tok = _load(lively_tiny_path)
    engine = TorchEngine.from_model(model, tok, quantize="int4", native_decode="auto")
    assert engine.runner.fused is not None and not engine.runner.fused.native
    assert engine.runner.packed is not None
    head = [p.kernel.decode for p in engine.runner.packed.layers if p.module is engine.runner.lm_head]
    assert not isinstance(head[0], quantized_linear.Q8Blocks)
    assert engine.plan.decode == "python" and "not built" in engine.plan.reasons["decode"]
    with pytest.raises(native.NativeBuildError, match="no C\\+\\+ compiler"):
        TorchEngine.from_model(model, tok, quantize="int4", native_decode="on")


def test_lora_rows_beside_base_rows_give_the_eager_forwards_numbers(
    lively_tiny_path: Path, tmp_path: Path
) -> None:
    # an adapter on every projection the lean forward multiplies side by side (the C++ loop's
    # LoRA rows are test_native_own.py's)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = make_lora_adapter(lively_tiny_path, tmp_path / "lora", seed=5, modules=modules)
    eager, lean = _engines(lively_tiny_path, adapter)
    assert lean.runner.fused is not None and lean.runner.fused.lora_problem is None
    assert not lean.runner.fused.native
    _assert_same_steps(eager, lean, "a")
    # the adapter changes its rows' decode logits (the comparison above is not of two base models)
    prompt = list(range(500, 520))
    logits = {}
    for slot, name in ((4, "a"), (5, None)):
        lean.runner.forward([], [PrefillRow(slot=slot, token_ids=prompt, start=0, adapter=name)])
        logits[name] = lean.runner.forward(
            [DecodeRow(slot=slot, token=3, position=len(prompt), adapter=name)], []
        )
    assert float((logits["a"] - logits[None]).norm()) > 1.0
    lean.unload_adapter_sync("a")
    assert lean.runner.fused is not None and lean.runner.fused.lora_problem is None


def test_decode_takes_the_eager_forward_where_the_lean_one_does_not_apply(
    lively_tiny_path: Path, tmp_path: Path
) -> None:
    from peft import LoraConfig, get_peft_model

    model, tok = _load(lively_tiny_path)
    # int8 decode in torch's per-channel kernel (a CPU without AVX512-VNNI): nothing to fuse (int4,
    # Q8_0 blocks times int8 rows and the model's own weights are)
    no_vnni = dataclasses.replace(cpu_features(), avx512_vnni=False)
    plan = plan_for(model, quantize="int8", platform=no_vnni)
    assert plan.layer_decode == "int8" and plan.decode == "reference", plan.reasons
    assert TorchEngine.from_model(model, tok, plan=plan).runner.fused is None
    runner = TorchEngine.from_model(
        model, tok, plan=plan_for(model, quantize="int4", decode="reference")
    ).runner
    assert runner.fused is None
    # a PEFT model whose adapter is not routed per row (the trainer's in-process engine)
    peft_model = get_peft_model(_load(lively_tiny_path)[0], LoraConfig(r=4, target_modules=["q_proj"]))
    trainer_runner = TorchEngine.from_model(peft_model, tok, quantize="int4").runner
    assert trainer_runner.fused is not None
    assert trainer_runner.fused.lora_problem == "the model's adapters are not routed per row"
    # a DoRA adapter is refused at loading, naming it (PEFT cannot route it per row)
    dora = tmp_path / "dora"
    dora_model = get_peft_model(
        _load(lively_tiny_path)[0],
        LoraConfig(r=4, target_modules=["q_proj"], use_dora=True, init_lora_weights=False),
    )
    dora_model.save_pretrained(dora)
    engine = TorchEngine.from_model(_load(lively_tiny_path)[0], tok, quantize="int4")
    with pytest.raises(AdapterError, match="DoRA"):
        engine.load_adapter_sync("d", str(dora))
    assert engine.runner.fused is not None and engine.runner.fused.lora_problem is None


def test_unsupported_names_the_model_type(lively_tiny_path: Path) -> None:
    model, tok = _load(lively_tiny_path)
    runner = TorchEngine.from_model(
        model, tok, plan=plan_for(model, quantize="int4", decode="reference")
    ).runner

    def problem() -> str | None:
        facts = ModelFacts.of(runner.model)
        return fused_decode.unsupported(
            facts.ops, facts.device, facts.dtype, "int4", runner.plan.layer_decode
        )

    assert problem() is None
    runner.config.model_type = "gpt2"
    try:
        assert problem() == (
            "model type 'gpt2' is not one of ['gemma3_text', 'granite', 'granitemoehybrid', 'llama', 'mistral', "
            "'phi3', 'qwen2', 'qwen3', 'smollm3']"
        )
    finally:
        runner.config.model_type = "llama"
