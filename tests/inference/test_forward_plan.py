"""The forward plan (``engine/plan.py``): resolved once from the model, the CPU and the settings,
the objects the runner builds follow it, ``reference`` is the Hugging Face modules, the plan is
logged once at start-up and served by ``/health`` and ``/v1/capabilities`` over real HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.common.config import SettingsError, check_unknown_env
from services.common.platforms import cpu_features
from services.inference.app import create_app
from services.inference.config import InferenceSettings
from services.inference.engine import TorchEngine, quantized_linear
from services.inference.engine.fused_decode import FusedDecode
from services.inference.engine.plan import ForwardPlan, PlanSettings, plan_for, resolve_plan
from tests.helpers.servers import serve_app
from tests.inference.test_api import _common
from tests.inference.test_fused_decode import _load

INT4 = quantized_linear.available("int4", torch.device("cpu")) is None
REMOVED = (
    "FUSED_DECODE",
    "FUSED_PROMPT",
    "NATIVE_PROMPT",
    "NATIVE_OPS",
    "PACKED_WEIGHTS",
    "DECODE_HEAD",
    "COMPILE",
)


def _built(engine: TorchEngine) -> dict[str, Any]:
    """What the runner built, in the plan's terms."""
    runner = engine.runner
    fused = runner.fused
    decode = "reference" if fused is None else ("native-own" if fused.native else "python")
    lean_prompt = runner.fused_prompt
    prompt = "reference" if lean_prompt is None else ("native" if lean_prompt.native else "python")
    return {
        "decode": decode,
        "prompt": prompt,
        "quantize": runner.quantize,
        "packed": runner.packed is not None,
    }


@pytest.mark.parametrize("quantize", ["none", "int4"] if INT4 else ["none"])
def test_the_engine_builds_what_the_plan_names(lively_tiny_path: Path, quantize: str) -> None:
    model, tok = _load(lively_tiny_path)
    # without the C++ kernels (they are test_native_own's)
    engine = TorchEngine.from_model(model, tok, quantize=quantize, native_decode="off")  # type: ignore[arg-type]
    plan = engine.plan
    assert plan == resolve_plan(model, None, PlanSettings(quantize=quantize, native_decode="off"))  # type: ignore[arg-type]
    built = _built(engine)
    assert built == {"decode": plan.decode, "prompt": plan.prompt, "quantize": quantize, "packed": True}
    if quantize == "int4":
        # as before the plan: int4 decode through the lean forward, prompts through the lean one
        assert plan.decode == "python" and plan.layer_decode == "int4"
        assert isinstance(engine.runner.fused, FusedDecode)
    else:
        # the model's own fp32 weights: the lean forward too, its products oneDNN's
        assert plan.decode == "python" and plan.layer_decode == "onednn-fp32"
        assert isinstance(engine.runner.fused, FusedDecode)
    assert plan.prompt == "python"
    assert set(plan.reasons) >= {
        "forward",
        "quantize",
        "family",
        "decode",
        "prompt",
        "layers",
        "head",
        "attention",
    }
    assert plan.reasons["family"] == "llama: Llama's layer"


def test_reference_is_the_hugging_face_modules(lively_tiny_path: Path) -> None:
    model, tok = _load(lively_tiny_path)
    engine = TorchEngine.from_model(model, tok, forward="reference", quantize="int4" if INT4 else "none")
    plan = engine.plan
    assert (plan.forward, plan.decode, plan.prompt) == ("reference", "reference", "reference")
    assert engine.runner.fused is None and engine.runner.fused_prompt is None
    plain = TorchEngine.from_model(model, tok, forward="reference")
    assert plain.runner.packed is None
    assert (plain.plan.layer_decode, plain.plan.head_decode) == ("torch", "torch")


def test_a_plan_made_by_hand_is_what_runs(lively_tiny_path: Path) -> None:
    model, tok = _load(lively_tiny_path)
    plan = plan_for(model, prompt="reference")
    assert plan.reasons["prompt"] == "set by hand"
    assert _built(TorchEngine.from_model(model, tok, plan=plan))["prompt"] == "reference"
    with pytest.raises(ValueError, match="decode='python'"):
        # the lean decode forward needs int4 decode or the model's own weights, not int8
        int8 = plan_for(model, quantize="int8")
        TorchEngine.from_model(model, tok, plan=dataclasses.replace(int8, decode="python"))


def test_the_platform_record_decides_cpu_choices(lively_tiny_path: Path) -> None:
    model, _ = _load(lively_tiny_path)
    if not INT4:
        pytest.skip("this torch build has no CPU weight-only int4 kernel")
    plain = dataclasses.replace(cpu_features(), avx512_bf16=False, amx_bf16=False, amx_usable=False)
    # without the C++ kernels no decode blocks to share: the model's own dtype
    off = PlanSettings(quantize="int4", native_decode="off")
    assert resolve_plan(model, plain, off).prompt_dtype == "float32"
    bf16 = dataclasses.replace(plain, avx512_bf16=True)
    settings = PlanSettings(quantize="int4")
    plan = quantized_linear.resolve_prompt_dtype(settings.prompt_dtype, "int4", torch.float32, bf16)
    assert plan == "bfloat16"


def test_removed_settings_are_refused_by_name() -> None:
    assert "forward" in InferenceSettings.model_fields
    for name in REMOVED:
        assert name.lower() not in InferenceSettings.model_fields
        with pytest.raises(SettingsError, match=f"TANDEM_INFERENCE_{name}"):
            check_unknown_env(InferenceSettings, environ={f"TANDEM_INFERENCE_{name}": "1"})
    assert InferenceSettings().forward == "auto"


def test_the_plan_is_logged_once_at_start(lively_tiny_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, tok = _load(lively_tiny_path)
    engine = TorchEngine.from_model(model, tok)

    async def run() -> None:
        await engine.start()
        await engine.shutdown()

    with caplog.at_level(logging.INFO, logger="tandem.engine.torch"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("forward plan:")]
    assert len(lines) == 1
    assert f"decode={engine.plan.decode}" in lines[0] and "\n" not in lines[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str, lively_tiny_path: Path) -> Iterator[str]:
    home = tmp_path_factory.mktemp("plan-home")
    settings = InferenceSettings(model=str(lively_tiny_path), served_model_name="tiny", max_batch_size=2)
    with serve_app(create_app(_common(home, redis_url), settings)) as url:
        yield url


def test_health_and_capabilities_serve_the_plan(server: str, key: str) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    health = httpx.get(server + "/health", headers=headers, timeout=60)
    assert health.status_code == 200, health.text
    body = health.json()
    assert body["engine"] == "torch" and body["model"] == "tiny"
    plan = body["forward_plan"]
    fields = {f.name for f in dataclasses.fields(ForwardPlan)}
    assert set(plan) == fields and plan["forward"] == "auto" and plan["reasons"]["decode"]
    caps = httpx.get(server + "/v1/capabilities", headers=headers, timeout=60).json()
    assert {k: caps[k] for k in ("engine", "adapters", "max_lora_rank", "register_models")} == {
        "engine": "torch",
        "adapters": True,
        "max_lora_rank": None,
        "register_models": True,
    }
    assert caps["forward_plan"] == plan
    assert httpx.get(server + "/health", timeout=60).status_code == 401
