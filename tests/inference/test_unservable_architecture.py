"""A model folder whose architecture no engine here serves stops start-up with one line naming
the architecture and what each engine serves; one transformers knows starts (on the lean
forward or, named in the forward plan, the Hugging Face one)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.common.config import CommonSettings
from services.inference.config import InferenceSettings
from services.inference.engines import build_engine, check_architecture


def folder(tmp_path: Path, config: dict[str, object]) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_an_unknown_architecture_is_a_one_line_start_up_error(tmp_path: Path) -> None:
    model = folder(
        tmp_path,
        {"model_type": "tandem_ring_net", "architectures": ["TandemRingNetForCausalLM"], "hidden_size": 8},
    )
    settings = InferenceSettings(model=str(model))
    common = CommonSettings(home=tmp_path / "home", redis_url="redis://127.0.0.1:9/0", log_json=False)
    with pytest.raises(ValueError) as caught:
        asyncio.run(build_engine(settings, common))
    message = str(caught.value)
    assert "\n" not in message
    assert f"TANDEM_INFERENCE_MODEL={model}" in message and "'tandem_ring_net'" in message
    # the engines that can serve, and what: the lean families, the HF fallback, GGUF, vLLM
    for named in ("llama", "qwen3", "gemma3_text", "Hugging Face", "llamacpp", "vllm"):
        assert named in message
    # nothing was loaded nor cached: the check runs before the weights are read
    assert not (tmp_path / "home" / "models").exists()


def test_a_config_without_model_type_is_named(tmp_path: Path) -> None:
    model = folder(tmp_path, {"hidden_size": 8})
    with pytest.raises(ValueError, match=r"a config\.json without a model_type cannot be served"):
        check_architecture(model, str(model))


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text", "gpt2", "falcon"])
def test_architectures_transformers_serves_pass(tmp_path: Path, model_type: str) -> None:
    """The lean families and the others transformers has a causal LM for (the Hugging Face
    forward, which the plan names) both start."""
    check_architecture(folder(tmp_path, {"model_type": model_type}), None)
