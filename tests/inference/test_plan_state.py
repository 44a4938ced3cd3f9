"""The forward plan follows what it depends on (``engine/plan.py``): an adapter the lean forwards
cannot serve moves their tokens to the Hugging Face modules in the plan, logged as one line, and
unloading it restores the plan; a training-mode switch moves the C++ loops to the Python ones; the
capability checks read a model's config, not a runner; ``PlanSettings`` defaults are the server's."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, Phi3Config

from services.inference.config import InferenceSettings
from services.inference.engine import TorchEngine, fused_decode, fused_prompt, native
from services.inference.engine.fused_decode import FusedDecode
from services.inference.engine.fused_prompt import FusedPrompt
from services.inference.engine.layer_ops import layer_ops
from services.inference.engine.plan import (
    ForwardPlan,
    ModelFacts,
    PlanSettings,
    in_state,
    plan_for,
    refusal,
)
from services.inference.engine.ragged import DecodeRow, PrefillRow
from tests.inference.test_fused_decode import _load

CPU = torch.device("cpu")


def _alora_adapter(base: Path, target: Path) -> Path:
    """A PEFT adapter of another kind than plain LoRA (activated LoRA: a ``lora_variant`` the lean
    forwards do not compute), made with PEFT itself."""
    from peft import LoraConfig, get_peft_model

    model, _ = _load(base)
    config = LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], alora_invocation_tokens=[5, 6], task_type="CAUSAL_LM"
    )
    get_peft_model(model, config).save_pretrained(target)
    return target


def _changes(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("forward plan changed")]


def test_an_adapter_the_lean_forwards_cannot_serve_changes_the_plan_and_unloading_restores_it(
    lively_tiny_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok = _load(lively_tiny_path)
    engine = TorchEngine.from_model(model, tok, plan=plan_for(model))
    before = engine.plan
    assert (before.decode, before.prompt) == ("python", "python")
    adapter = _alora_adapter(lively_tiny_path, tmp_path / "alora")
    with caplog.at_level(logging.INFO, logger="tandem.engine.runner"):
        engine.load_adapter_sync("act", str(adapter))
    after = engine.plan
    assert (after.decode, after.prompt) == ("reference", "reference")
    assert "an adapter of another kind than plain LoRA" in after.reasons["decode"]
    assert after.reasons["prompt"] == after.reasons["decode"]
    # what the server reports is the plan that runs
    assert engine.runner.plan is after
    [line] = _changes(caplog)
    assert line.startswith("forward plan changed (adapter 'act' loaded): decode python -> reference (")
    assert "; prompt python -> reference (" in line and "\n" not in line
    # its steps run the Hugging Face modules: the lean forwards are not called
    assert engine.runner.fused is not None and engine.runner.fused_prompt is not None
    calls: list[Any] = []
    for lean in (FusedDecode, FusedPrompt):
        monkeypatch.setattr(lean, "__call__", lambda *a: calls.append(a))
    engine.runner.forward([], [PrefillRow(slot=0, token_ids=list(range(10, 20)), start=0)])
    engine.runner.forward([DecodeRow(slot=0, token=7, position=10)], [])
    assert calls == []
    monkeypatch.undo()

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tandem.engine.runner"):
        engine.unload_adapter_sync("act")
    assert engine.plan.paths() == before.paths() and dict(engine.plan.reasons) == dict(before.reasons)
    [line] = _changes(caplog)
    assert line.startswith("forward plan changed (adapter 'act' unloaded): decode reference -> python (")


def test_a_plain_lora_adapter_leaves_the_plan_as_it_is(
    lively_tiny_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.helpers.models import make_lora_adapter

    model, tok = _load(lively_tiny_path)
    engine = TorchEngine.from_model(model, tok, plan=plan_for(model))
    before = engine.plan
    adapter = make_lora_adapter(lively_tiny_path, tmp_path / "lora", seed=3)
    with caplog.at_level(logging.INFO, logger="tandem.engine.runner"):
        engine.load_adapter_sync("a", str(adapter))
    assert engine.plan is before and _changes(caplog) == []


def test_the_health_route_serves_the_plan_that_runs(lively_tiny_path: Path, tmp_path: Path) -> None:
    model, tok = _load(lively_tiny_path)
    engine = TorchEngine.from_model(model, tok, plan=plan_for(model))
    engine.load_adapter_sync("act", str(_alora_adapter(lively_tiny_path, tmp_path / "alora")))

    async def health() -> dict[str, Any]:
        await engine.start()
        try:
            return await engine.health()
        finally:
            await engine.shutdown()

    served = asyncio.run(health())["forward_plan"]
    assert isinstance(served, dict)
    assert (served["decode"], served["prompt"]) == ("reference", "reference")


def test_the_plan_in_a_state_moves_only_the_paths_the_state_rules_out() -> None:
    # the state alone: no model, no C++ build
    plan = dataclasses.replace(
        _a_plan(),
        decode="native-own",
        prompt="native",
        attention="own/invariant",
        layer_prompt="onednn-bf16-blocks",
    )
    training = in_state(plan, lora_problem=None, training=True)
    assert (training.decode, training.prompt, training.attention) == ("python", "python", "invariant")
    # the C++ prompt layers' own attention goes with them
    own = in_state(dataclasses.replace(plan, attention="own"), lora_problem=None, training=True)
    assert own.attention == "invariant" and "C++" not in own.reasons["attention"]
    assert "training mode" in training.reasons["decode"] and "training mode" in training.reasons["prompt"]
    assert in_state(plan, lora_problem=None, training=False) is plan
    routed = in_state(plan, lora_problem="why", training=True)
    assert (routed.decode, routed.prompt) == ("reference", "reference")
    assert routed.reasons["decode"] == "the Hugging Face modules: why"


def _a_plan() -> ForwardPlan:
    """A plan made by hand (no model): int4 decode in the Python loop, bf16 block prompts."""
    return ForwardPlan(
        forward="auto",
        quantize="int4",
        prompt_dtype="bfloat16",
        decode="python",
        prompt="python",
        layer_decode="int4-q8",
        layer_prompt="onednn-bf16-blocks",
        head_decode="q8_0",
        head_prompt="onednn-fp32",
        attention="invariant",
        reasons={"decode": "d", "prompt": "p", "attention": "a"},
    )


def test_a_training_mode_switch_resolves_the_plan_again(
    lively_tiny_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if not native.avx2() or not native.start("auto"):
        pytest.skip(f"the C++ kernels are not built here ({native.problem()})")
    model, tok = _load(lively_tiny_path)
    engine = TorchEngine.from_model(model, tok, plan=plan_for(model, native_decode="on"))
    runner = engine.runner
    assert engine.plan.decode == "native-own" and runner.fused is not None and runner.fused.native
    prompt = PrefillRow(slot=0, token_ids=list(range(10, 20)), start=0)
    with caplog.at_level(logging.INFO, logger="tandem.engine.runner"):
        model.train()
        runner.forward([], [prompt])
        assert engine.plan.decode == "python" and not runner.fused.native
        assert "training mode" in engine.plan.reasons["decode"]
        model.eval()
        runner.forward([DecodeRow(slot=0, token=7, position=10)], [])
    assert engine.plan.decode == "native-own" and runner.fused.native
    entered, left = _changes(caplog)
    assert entered.startswith(
        "forward plan changed (the model entered training mode): decode native-own -> python"
    )
    assert left.startswith("forward plan changed (the model left training mode): decode python -> native-own")


def test_capability_checks_read_a_config_alone() -> None:
    llama = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    ops = layer_ops(llama, [])
    assert not isinstance(ops, str)
    fp32 = torch.float32
    # decode tokens
    assert fused_decode.unsupported(ops, CPU, fp32, "int4", "int4-q8") is None
    assert fused_decode.unsupported(ops, CPU, fp32, "none", "onednn-fp32") is None
    assert fused_decode.unsupported(ops, CPU, fp32, "int8", "q8_0-int8") is None
    assert fused_decode.unsupported(ops, CPU, fp32, "int8", "int8") == (
        "the decoder layers decode with int8, not Q8_0 blocks times int8 rows in every layer"
    )
    assert fused_decode.unsupported(ops, CPU, torch.bfloat16, "int8", "q8_0-int8") == (
        "int8 decode of a model that is not fp32"
    )
    assert fused_decode.unsupported(ops, CPU, fp32, "int4", "int4|onednn-bf16") == (
        "the decoder layers decode with int4|onednn-bf16, not int4 in every layer"
    )
    assert fused_decode.unsupported(ops, CPU, torch.float16, "none", "onednn-fp16") is not None
    gpt2 = layer_ops(GPT2Config(), [])
    assert isinstance(gpt2, str) and "'gpt2'" in gpt2
    assert fused_decode.unsupported(gpt2, CPU, fp32, "none", "onednn-fp32") == gpt2
    # prompt chunks
    assert fused_prompt.unsupported(ops, CPU, "onednn-bf16-blocks") is None
    assert fused_prompt.unsupported(ops, torch.device("meta"), "onednn-fp32") == (
        "prompt products are oneDNN's or the own int8 rows' CPU kernels; the model runs on meta"
    )
    assert fused_prompt.unsupported(ops, CPU, "int4-q8") is None
    assert "multiply with torch" in str(fused_prompt.unsupported(ops, CPU, "torch"))
    assert (
        fused_prompt.unsupported(ops, CPU, "onednn-bf16-blocks|onednn-fp32")
        == "the layers' prompt kernels differ"
    )
    # the C++ loop's own operations
    assert fused_decode.own_unsupported(llama, fp32) is None
    # a bf16 model's weights as they are in decode; the prompt layers take fp32 models
    assert fused_decode.own_unsupported(llama, torch.bfloat16) is None
    assert fused_decode.own_unsupported(llama, torch.bfloat16, prompt=True) == (
        "the C++ prompt layers take fp32 models; the model is torch.bfloat16"
    )
    assert fused_decode.own_unsupported(llama, torch.float16) == (
        "the C++ loop takes fp32 or bf16 weights and KV slabs; the model is torch.float16"
    )
    odd = LlamaConfig(hidden_size=96, intermediate_size=128, num_attention_heads=4, head_dim=24)
    assert fused_decode.own_unsupported(odd, fp32) == "head_dim 24 is not one of [16, 32, 64, 128]"
    phi = Phi3Config(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, partial_rotary_factor=0.25
    )
    assert fused_decode.rotary_dim(phi) == 8
    assert fused_decode.own_unsupported(phi, fp32) == "8 rotary dimensions are not a multiple of 16"


def test_a_plan_made_by_hand_that_the_model_cannot_run_is_refused_by_name() -> None:
    odd = LlamaConfig(hidden_size=96, intermediate_size=128, num_attention_heads=4, head_dim=24)
    facts = ModelFacts(config=odd, ops=layer_ops(odd, []), dtype=torch.float32, device=CPU)
    plan = _a_plan()
    assert refusal(plan, facts) is None
    assert refusal(dataclasses.replace(plan, decode="native-own"), facts) == (
        "decode='native-own': head_dim 24 is not one of [16, 32, 64, 128]"
    )
    assert refusal(dataclasses.replace(plan, prompt="native", layer_prompt="onednn-fp32"), facts) == (
        "prompt='native': the C++ prompt layers multiply in bf16 blocks or int4/Q8_0 blocks times int8 rows, "
        "not onednn-fp32"
    )
    assert refusal(dataclasses.replace(plan, quantize="int8"), facts) == (
        "decode='python': the decoder layers decode with int4-q8, not Q8_0 blocks times int8 rows in every layer"
    )


def test_plan_settings_defaults_are_the_servers() -> None:
    fields = [f.name for f in dataclasses.fields(PlanSettings)]
    assert fields == ["forward", "quantize", "prompt_dtype", "native_decode", "kv_dtype"]
    server = InferenceSettings.model_fields
    assert {name: getattr(PlanSettings(), name) for name in fields} == {
        name: server[name].default for name in fields
    }
    assert PlanSettings().quantize == "auto" and PlanSettings().native_decode == "auto"
    assert PlanSettings().kv_dtype == "model"
