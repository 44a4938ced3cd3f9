"""The model families on the lean forwards (``engine/layer_ops.py``): for each, a tiny
random-initialised model of that architecture built here, served through the C++ layer loop and
the Python loop, checked against transformers' own modelling of it.

Tolerances: with the model's fp32 weights (oneDNN's products) each logit is within 1e-4 of
transformers' (relative to the largest), and greedy tokens equal ``generate``'s. With its bf16
weights (the C++ loop multiplying them as they are, its residual stream fp32; transformers rounds
every operation to bf16) each logit is within 5e-2 of transformers' forward of the same weights in
fp32 (measured, the worst of the five families with and without LoRA: the C++ loop 2.6e-2, the
Python loop 2.8e-2, transformers' own bf16 forward 3.9e-2), the first greedy token equals
transformers' bf16 ``generate``'s and every later one is its top token or a near tie within that
tolerance (bf16's rounding decides which way: at most 2.6e-2 below its top, in the Python loop
as in the C++ one). With int4 decode
the engine multiplies other values than the fp32 model (the weights in Q4_1 groups, the rows as
int8), so its greedy tokens (at least three prompts of four: the C++ loop's own sums may flip a near
tie of a random model) are compared with those of the engine's reference forward (the Hugging Face modules themselves, multiplying with the
same int4 kernels), which is what the lean forward's operations must reproduce. Each is checked
alone and in a full batch of four, with and without a LoRA adapter on every projection."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.platforms import cpu_features
from services.inference.engine import TorchEngine, native, quantized_linear
from services.inference.engine.layer_ops import layer_ops
from services.inference.engine.plan import plan_for
from services.inference.engine.ragged import DecodeRow, PrefillRow

pytestmark = pytest.mark.skipif(
    quantized_linear.available("int4", torch.device("cpu")) is not None or not native.avx2(),
    reason="needs torch's CPU int4 kernel and an AVX2 CPU",
)

SIZES = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
ARCHITECTURES = ["llama3", "qwen2", "qwen3", "mistral", "gemma3", "granite", "granite4", "smollm3", "phi3"]
# the projections each family's LoRA adapter targets (every one the layer loop multiplies)
LORA_MODULES = {
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "granite4": ["q_proj", "k_proj", "v_proj", "o_proj", "input_linear", "output_linear"],
}
LLAMA_LORA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [list(range(300 + 11 * i, 318 + 13 * i)) for i in range(4)]
# a bf16 model's logits against transformers' forward of its weights in fp32, relative to the largest
BF16_TOLERANCE = 5e-2
NEW_TOKENS = 8


def _config(arch: str, vocab: int) -> Any:
    import transformers as tf

    sizes = {**SIZES, "vocab_size": vocab}
    if arch == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return tf.LlamaConfig(**sizes, rope_parameters=rope)
    if arch == "qwen2":
        return tf.Qwen2Config(**sizes)
    if arch == "qwen3":
        return tf.Qwen3Config(**sizes, head_dim=32)
    if arch == "mistral":
        return tf.MistralConfig(**sizes, sliding_window=None)
    if arch == "gemma3":
        # a head of its own: Gemma's tied head over its scaled embeddings repeats one token
        return tf.Gemma3TextConfig(
            **{**sizes, "tie_word_embeddings": False},
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=256,
            layer_types=["sliding_attention", "full_attention"],
        )
    if arch == "granite":
        return tf.GraniteConfig(
            **sizes,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.05,
            logits_scaling=4.0,
        )
    if arch == "granite4":
        # Granite 4.0 dense (the "micro" models): every layer attention, no experts
        return tf.GraniteMoeHybridConfig(
            **sizes,
            shared_intermediate_size=SIZES["intermediate_size"],
            num_local_experts=0,
            layer_types=["full_attention"] * SIZES["num_hidden_layers"],
            position_embedding_type="rope",
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.05,
            logits_scaling=4.0,
        )
    if arch == "smollm3":
        return tf.SmolLM3Config(**sizes, no_rope_layers=[1, 0], no_rope_layer_interval=2)
    if arch == "phi3":
        config = tf.Phi3Config(**sizes)
        config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.5}
        return config
    raise KeyError(arch)


def _build(arch: str, vocab: int, dtype: torch.dtype = torch.float32, config: Any = None) -> Any:
    """The architecture (``config``: one of it, else ``_config``'s) with weights large enough that
    greedy decoding wanders (not one token repeated), norms away from their initial values (Gemma's
    from 0, the others' from 1)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _config(arch, vocab) if config is None else config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    embed_std = {"gemma3": 0.05, "granite": 0.2, "granite4": 0.2}.get(
        arch, 0.5
    )  # Gemma scales its embeddings by ~11
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = embed_std if "embed" in name else 0.5 if "lm_head" in name else 0.15
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.to(dtype)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def _adapter(model: Any, arch: str, target: Path) -> Path:
    """A PEFT LoRA adapter on every projection of ``model``'s layers, B not zero."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=LORA_MODULES.get(arch, LLAMA_LORA), init_lora_weights=False
    )
    torch.manual_seed(3)
    peft_model = get_peft_model(copy.deepcopy(model), config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    peft_model.save_pretrained(target)
    return target


def _transformers(model: Any, adapter: Path | None) -> Any:
    if adapter is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(model), str(adapter)).eval()


def _generate(model: Any, prompt: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
    )
    return [int(t) for t in out[0, len(prompt) :]]


def _engine(model: Any, tokenizer: Any, plan: Any, adapter: Path | None) -> TorchEngine:
    engine = TorchEngine.from_model(model, tokenizer, max_batch_size=len(PROMPTS), plan=plan)
    if adapter is not None:
        engine.load_adapter_sync("a", str(adapter))
    return engine


def _greedy(engine: TorchEngine, prompts: list[list[int]], adapter: str | None) -> list[list[int]]:
    """Greedy tokens of ``prompts`` decoded together, one slot each, through the runner's forwards
    (the prompts in one step, then one decode token of each a step)."""
    runner = engine.runner
    logits = runner.forward(
        [], [PrefillRow(slot=s, token_ids=p, start=0, adapter=adapter) for s, p in enumerate(prompts)]
    )
    out: list[list[int]] = [[int(t)] for t in logits.argmax(-1)]
    for step in range(NEW_TOKENS - 1):
        rows = [
            DecodeRow(slot=s, token=out[s][-1], position=len(p) + step, adapter=adapter)
            for s, p in enumerate(prompts)
        ]
        for s, t in enumerate(runner.forward(rows, []).argmax(-1)):
            out[s].append(int(t))
    return out


def _alone_and_batched(engine: TorchEngine, adapter: str | None) -> list[list[int]]:
    """Greedy tokens of every prompt alone, asserted equal to those in one full batch."""
    alone = [_greedy(engine, [p], adapter)[0] for p in PROMPTS]
    assert _greedy(engine, PROMPTS, adapter) == alone
    return alone


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _logits(engine: TorchEngine, adapter: str | None) -> list[torch.Tensor]:
    """The engine's logits at a prompt's last token and at two decode steps after it."""
    prompt = PROMPTS[1]
    runner = engine.runner
    got = [runner.forward([], [PrefillRow(slot=0, token_ids=prompt, start=0, adapter=adapter)])[0]]
    for i, token in enumerate((777, 4321)):
        got.append(
            runner.forward([DecodeRow(slot=0, token=token, position=len(prompt) + i, adapter=adapter)], [])[0]
        )
    return got


def _logit_error(engine: TorchEngine, reference: Any, adapter: str | None) -> float:
    """The largest relative error of ``_logits`` against transformers' forward over the same tokens."""
    prompt = PROMPTS[1]
    with torch.no_grad():
        ref = reference(torch.tensor([[*prompt, 777, 4321]])).logits[0]
    return max(_relative(g, ref[len(prompt) - 1 + i]) for i, g in enumerate(_logits(engine, adapter)))


def _plan(model: Any, path: str) -> Any:
    if path in ("int4", "int8"):
        plan = plan_for(model, quantize=path, native_decode="on")
    else:
        plan = plan_for(model, quantize="none", native_decode="on" if path == "native" else "off")
    return plan


@pytest.mark.parametrize("with_adapter", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fp32_weights_through_the_cpp_and_python_loops_equal_transformers(
    arch: str, with_adapter: bool, tokenizer: Any, tmp_path: Path
) -> None:
    model = _build(arch, len(tokenizer))
    adapter = _adapter(model, arch, tmp_path / "lora") if with_adapter else None
    reference = _transformers(model, adapter)
    expected = [_generate(reference, p) for p in PROMPTS]
    assert len(set(expected[0])) > 2, "a degenerate model tests nothing"
    for path in ("native", "python"):
        plan = _plan(model, path)
        assert plan.decode == ("native-own" if path == "native" else "python"), plan.reasons["decode"]
        assert plan.reasons["family"].startswith(str(model.config.model_type))
        engine = _engine(model, tokenizer, plan, adapter)
        name = "a" if adapter is not None else None
        lean = engine.runner.fused
        assert lean is not None and lean.lora_problem is None and lean.native == (path == "native")
        assert _alone_and_batched(engine, name) == expected, path
        assert _logit_error(engine, reference, name) < 1e-4, path


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_int4_through_the_cpp_loop_follows_the_reference_forward(
    arch: str, tokenizer: Any, tmp_path: Path
) -> None:
    model = _build(arch, len(tokenizer))
    adapter = _adapter(model, arch, tmp_path / "lora")
    lean_plan = _plan(model, "int4")
    assert lean_plan.decode == "native-own" and lean_plan.prompt == "native", lean_plan.reasons
    _follows_the_reference_forward(model, tokenizer, lean_plan, adapter)


def _follows_the_reference_forward(model: Any, tokenizer: Any, lean_plan: Any, adapter: Path) -> None:
    """The C++ loop under ``lean_plan`` against the Hugging Face modules with the same kernels,
    alone and batched, without and with the adapter."""
    reference_plan = dataclasses.replace(lean_plan, decode="reference", prompt="reference")
    lean = _engine(model, tokenizer, lean_plan, adapter)
    reference = _engine(model, tokenizer, reference_plan, adapter)
    assert lean.runner.fused is not None and lean.runner.fused.native
    assert reference.runner.fused is None
    for name in (None, "a"):
        ours, theirs = _alone_and_batched(lean, name), _alone_and_batched(reference, name)
        # the C++ loop's own sums on bf16-rounded prompt products may flip a near tie of a random
        # model's first token: at most one prompt of four
        assert sum(a == b for a, b in zip(ours, theirs, strict=True)) >= 3, (name, ours, theirs)
        errors = [_relative(a, b) for a, b in zip(_logits(lean, name), _logits(reference, name), strict=True)]
        assert max(errors) < 2e-2, (name, errors)


@pytest.mark.skipif(
    not cpu_features().avx512_vnni, reason="int8 decode as Q8_0 x int8 rows needs AVX512-VNNI"
)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_int8_through_the_cpp_loop_follows_the_reference_forward(
    arch: str, tokenizer: Any, tmp_path: Path
) -> None:
    model = _build(arch, len(tokenizer))
    adapter = _adapter(model, arch, tmp_path / "lora")
    lean_plan = _plan(model, "int8")
    assert (lean_plan.decode, lean_plan.layer_decode, lean_plan.head_decode) == (
        "native-own",
        "q8_0-int8",
        "q8_0-int8",
    ), lean_plan.reasons
    _follows_the_reference_forward(model, tokenizer, lean_plan, adapter)


def _near_top(reference: Any, prompt: list[int], tokens: list[int], tolerance: float) -> list[bool]:
    """Whether each of ``tokens`` (greedy after ``prompt``) is transformers' top token there given
    the ones before it, or its logit within ``tolerance`` of the top one (relative to the row's
    largest): a near tie that rounding decides."""
    with torch.no_grad():
        logits = reference(torch.tensor([[*prompt, *tokens]])).logits[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    top = logits.max(-1).values
    return [bool(g) for g in (top - chosen) <= tolerance * logits.abs().max(-1).values]


@pytest.mark.parametrize("with_adapter", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "phi3", "llama3", "granite", "granite4"])
def test_bf16_weights_through_the_cpp_and_python_loops_near_transformers(
    arch: str, with_adapter: bool, tokenizer: Any, tmp_path: Path
) -> None:
    model = _build(arch, len(tokenizer), torch.bfloat16)
    adapter = _adapter(model, arch, tmp_path / "lora") if with_adapter else None
    reference = _transformers(model, adapter)
    expected = [_generate(reference, p) for p in PROMPTS]
    # transformers' forward of the same (bf16-valued) weights computed in fp32: the values both
    # bf16 forwards round
    exact = _transformers(copy.deepcopy(model).float(), adapter)
    name = "a" if adapter is not None else None
    for path in ("native", "python"):
        plan = plan_for(model, quantize="none", native_decode="on" if path == "native" else "off")
        # the model's bf16 weights and KV slabs as they are (no fp32 copy of either)
        assert plan.decode == ("native-own" if path == "native" else "python"), plan.reasons
        assert plan.layer_decode == "onednn-bf16", plan.layer_decode
        if path == "native":
            assert "oneDNN bfloat16 products" in plan.reasons["decode"], plan.reasons
        engine = _engine(model, tokenizer, plan, adapter)
        lean = engine.runner.fused
        assert lean is not None and lean.native == (path == "native") and lean.lora_problem is None
        assert engine.runner.cache.k[0].dtype == torch.bfloat16
        alone = _alone_and_batched(engine, name)
        # transformers rounds every operation's output to bf16 (its residual stream too; the C++
        # loop's is fp32), so its near ties may go the other way: the first tokens equal, every
        # later one transformers' top token or within the logits' tolerance of it
        assert [a[0] for a in alone] == [e[0] for e in expected], (path, alone, expected)
        for prompt, tokens in zip(PROMPTS, alone, strict=True):
            assert all(_near_top(reference, prompt, tokens, BF16_TOLERANCE)), (path, prompt, tokens)
        assert _logit_error(engine, exact, name) < BF16_TOLERANCE, path


def test_layer_ops_name_what_the_loop_cannot_compute(tokenizer: Any) -> None:
    model = _build("gemma3", len(tokenizer))
    config = model.config
    config.attn_logit_softcapping = 50.0
    assert (
        layer_ops(config, model.model.layers) == "attention scores are soft-capped (attn_logit_softcapping)"
    )
    config.attn_logit_softcapping = None
    config.hidden_activation = "relu2"
    assert "activation 'relu2'" in str(layer_ops(config, model.model.layers))
    config.model_type = "gpt2"
    assert str(layer_ops(config, model.model.layers)).startswith("model type 'gpt2' is not one of")
    granite = _build("granite4", len(tokenizer))
    hybrid = copy.deepcopy(granite.config)
    hybrid.layer_types = ["linear_attention", "full_attention"]
    assert layer_ops(hybrid, granite.model.layers) == (
        "Granite 4.0 hybrid: 1 of 2 layers are Mamba layers, not attention"
    )
    experts = copy.deepcopy(granite.config)
    experts.num_local_experts = 4
    assert layer_ops(experts, granite.model.layers) == "Granite 4.0 with 4 experts (mixture of experts)"
