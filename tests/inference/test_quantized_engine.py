"""Weight-only int8/int4 quantised products in the torch engine (``TANDEM_INFERENCE_QUANTIZE``):
int4 gives GGUF Q4_1 weights back exactly, greedy output is the same alone and in a full batch
(prompt tokens in fp32 or bf16, ``TANDEM_INFERENCE_PROMPT_DTYPE``), LoRA adapters apply on the
quantised base, a server serves chat and streams with it, and a setting that cannot run stops
start-up naming it."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from pydantic import ValidationError

from services.common.config import CommonSettings
from services.common.embedding_models import cpu_has_native_bf16
from services.inference.app import create_app
from services.inference.config import InferenceSettings
from services.inference.engine import SamplingParams, TorchEngine, packed_linear, quantized_linear
from services.inference.engine.packed_linear import OneDNNPacked, PackedLinears
from services.inference.engine.quantized_linear import (
    INT4_GROUP,
    PROMPT_BLOCK,
    PROMPT_BLOCK_MAX,
    BlockedBF16,
    ByTokenKind,
    Int4WeightOnly,
    Int8WeightOnly,
)
from services.inference.engine.ragged import DecodeRow, PrefillRow
from services.inference.engine.types import EngineRequest
from services.inference.engines import build_torch_engine, quantize_mode
from tests.helpers.models import make_lora_adapter
from tests.helpers.servers import serve_app

# oneDNN packs bf16 weights only on CPUs with bf16 instructions (not an AVX2-only one): there the
# head decodes in the model's dtype and a bf16 prompt is refused at start, naming it
ONEDNN_BF16 = packed_linear.available(torch.device("cpu"), torch.bfloat16)

pytestmark = pytest.mark.skipif(
    quantized_linear.available("int4", torch.device("cpu")) is not None
    or quantized_linear.available("int8", torch.device("cpu")) is not None,
    reason="this torch build has no CPU weight-only int4/int8 kernels",
)

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three fruits.", "hi"]


def _chat(tok: Any, q: str) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _load(path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32
    ).eval(), AutoTokenizer.from_pretrained(path)


def _q4_1_weight(out_f: int, in_f: int) -> torch.Tensor:
    """A weight as a Q4_1 GGUF de-quantises to: 4-bit values in blocks of 32, a scale and a minimum each."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (out_f, in_f // INT4_GROUP, INT4_GROUP), generator=gen).float()
    scale = torch.rand(out_f, in_f // INT4_GROUP, 1, generator=gen) * 0.01 + 0.001
    low = -8 * scale + torch.randn(out_f, in_f // INT4_GROUP, 1, generator=gen) * 0.002
    q[..., 0], q[..., 1] = 0, 15  # every block spans its whole range, as Q4_1's quantiser leaves it
    return (q * scale + low).view(out_f, in_f)


def test_int4_gives_q4_1_weights_back_and_int8_is_close() -> None:
    layer = torch.nn.Linear(256, 96, bias=True)
    with torch.no_grad():
        layer.weight.copy_(_q4_1_weight(96, 256))
    x = torch.randn(5, 256)
    # the kernels multiply bf16 activations: the reference is the fp32 product of the same bf16 inputs
    ref = torch.nn.functional.linear(x.bfloat16().float(), layer.weight, layer.bias)
    for kernel, tolerance in ((Int4WeightOnly(), 0.01), (Int8WeightOnly(), 0.03)):
        model = torch.nn.Sequential(copy.deepcopy(layer))
        quantised = PackedLinears(model, choose=lambda _n, _m, k=kernel: k)  # type: ignore[misc]
        with torch.inference_mode():
            with quantised.active():
                out = model(x)
            error = float((out - ref).norm() / ref.norm())
            assert error < tolerance, (type(kernel).__name__, error)
            assert quantised.layers[0].weight[0].dtype in (torch.int8, torch.uint8, torch.int32)
            # outside the engine's forwards the layer is plain fp32 again
            assert "forward" not in vars(model[0])
            torch.testing.assert_close(model(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


@pytest.fixture(scope="module")
def lively(lively_tiny_path: Path) -> tuple[Any, Any]:
    return _load(lively_tiny_path)


@pytest.mark.parametrize(
    ("mode", "prompt_dtype"), [("int4", "bfloat16"), ("int4", "float32"), ("int8", "auto")]
)
def test_greedy_is_the_same_alone_and_in_a_full_batch(
    lively: tuple[Any, Any], mode: str, prompt_dtype: str
) -> None:
    model, tok = lively
    prompts = [_chat(tok, q) for q in QUESTIONS] + [list(range(300, 340)), list(range(900, 917))]
    # without the C++ kernels: the layers' own int4 products and head (the kernels: test_native_own)
    settings: dict[str, Any] = {"quantize": mode, "prompt_dtype": prompt_dtype, "native_decode": "off"}
    if prompt_dtype == "bfloat16" and not ONEDNN_BF16:
        with pytest.raises(ValueError, match="prompt_dtype='bfloat16'"):
            TorchEngine.from_model(model, tok, max_batch_size=4, prefill_chunk=32, **settings)
        return
    engine = TorchEngine.from_model(model, tok, max_batch_size=4, prefill_chunk=32, **settings)
    assert engine.runner.packed is not None
    kinds = {type(p.kernel.decode).__name__ for p in engine.runner.packed.layers}  # type: ignore[attr-defined]
    head = "BF16Packed" if ONEDNN_BF16 else "OneDNNPacked"
    assert kinds == ({"Int4WeightOnly", head} if mode == "int4" else {"Int8WeightOnly"})
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    batch = engine.generate_batch(prompts, greedy)  # 6 prompts in 4 slots: they join as others leave
    assert len({tuple(o.token_ids) for o in batch}) == len(prompts), "outputs should differ per prompt"
    for prompt, out in zip(prompts, batch, strict=True):
        alone = engine.generate_batch([prompt], greedy)[0]
        assert alone.token_ids == out.token_ids
        # bit for bit: each row is computed alike whatever shares its forward (the bf16
        # activations of the quantised products would turn any last-bit difference into a
        # different token, sooner or later, on a real model)
        assert alone.logprobs == out.logprobs
    again = engine.generate_batch(prompts, greedy)
    assert [o.token_ids for o in again] == [o.token_ids for o in batch]
    # the model itself is untouched: still fp32, still transformers' own forward outside the engine
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all("forward" not in vars(m) for m in model.modules())


@pytest.mark.e2e
def test_smollm2_default_decodes_alike_alone_and_in_a_full_batch(smollm2_path: Path) -> None:
    """The default model and setting (SmolLM2 from its Q4_1 GGUF, ``auto``: int4 decode, bf16
    activations): the greedy tokens and logprobs of 6 of the prompts alone (each alone takes
    seconds) equal theirs in a batch of 16 (split, shared prompt chunks; 16 rows decoding).
    Before the attention was made invariant, 3 of 16 GSM8K prompts' tokens and all their
    logprobs differed."""
    model, tok = _load(smollm2_path)
    engine = TorchEngine.from_model(model, tok, max_batch_size=16, quantize="auto")
    assert engine.runner.quantize == "int4"
    topics = ["the sea", "a library", "trains", "bread", "winter", "a lighthouse", "chess", "bees"]
    asks = [f"Write two sentences about {t}, then count from one to {3 + i}." for i, t in enumerate(topics)]
    prompts = [_chat(tok, q) for q in asks + [f"Tell me a fact about the number {n}." for n in range(8)]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    batch = engine.generate_batch(prompts, greedy)
    for prompt, out in zip(prompts[:6], batch[:6], strict=True):
        alone = engine.generate_batch([prompt], greedy)[0]
        assert (alone.token_ids, alone.logprobs) == (out.token_ids, out.logprobs)


def test_prompt_dtype_multiplies_prompt_tokens_in_bf16_and_the_head_in_fp32(lively: tuple[Any, Any]) -> None:
    """``TANDEM_INFERENCE_PROMPT_DTYPE``: ``bfloat16`` multiplies prompt tokens in the decoder
    layers in bf16 (the head's prompt rows and every decode token as before); the first token's
    logits then move a little from the fp32 prompt's, which equal the unquantised engine's.
    ``auto`` takes bf16 only where decode is quantised on a CPU with native bf16."""
    model, tok = lively
    resolve = quantized_linear.resolve_prompt_dtype
    native = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert resolve("auto", "int4", torch.float32) == native
    assert resolve("auto", "int8", torch.float32) == native
    assert resolve("auto", "none", torch.float32) == "float32"  # fp32 serving stays fp32
    assert resolve("float32", "int4", torch.float32) == "float32"
    assert resolve("bfloat16", "none", torch.float32) == "bfloat16"
    assert resolve("bfloat16", "int4", torch.bfloat16) == "auto"  # a bf16 model: its own dtype
    head = model.get_output_embeddings()
    prompt = _chat(tok, QUESTIONS[1])
    first: dict[str, torch.Tensor] = {}
    for quantize, dtype in [
        ("none", "float32"),
        ("int4", "float32"),
        ("int4", "bfloat16"),
        ("none", "bfloat16"),
    ]:
        if dtype == "bfloat16" and not ONEDNN_BF16:
            with pytest.raises(ValueError, match="prompt_dtype='bfloat16'"):
                TorchEngine.from_model(copy.deepcopy(model), tok, quantize=quantize, prompt_dtype=dtype)  # type: ignore[arg-type]
            continue
        engine = TorchEngine.from_model(
            copy.deepcopy(model),
            tok,
            quantize=quantize,  # type: ignore[arg-type]
            prompt_dtype=dtype,  # type: ignore[arg-type]
        )
        assert engine.runner.prompt_dtype == dtype
        if quantize == "int4" or dtype == "bfloat16":
            assert engine.runner.packed is not None
            for packed in engine.runner.packed.layers:
                is_head = packed.module is engine.runner.lm_head
                kernel = packed.kernel
                prompt_kernel = kernel.prompt if isinstance(kernel, ByTokenKind) else kernel
                want = BlockedBF16 if dtype == "bfloat16" and not is_head else OneDNNPacked
                assert type(prompt_kernel) is want, (packed.module, kernel)
        first[f"{quantize}/{dtype}"] = engine.runner.forward([], [PrefillRow(0, prompt, 0)])[0]
    assert head is model.get_output_embeddings()
    fp32 = first["none/float32"]
    # fp32 prompt tokens: the unquantised engine's logits exactly (quantisation is decode-only)
    assert torch.equal(first["int4/float32"], fp32)
    if not ONEDNN_BF16:
        return
    for key in ("int4/bfloat16", "none/bfloat16"):
        moved = float((first[key] - fp32).norm() / fp32.norm())
        assert 0 < moved < 0.05, (key, moved)
    assert torch.equal(first["int4/bfloat16"], first["none/bfloat16"])


@pytest.mark.skipif(
    not packed_linear.available(torch.device("cpu"), torch.bfloat16),
    reason="no oneDNN bf16 products in this build",
)
def test_a_bf16_prompt_rows_product_does_not_depend_on_the_rows_beside_it() -> None:
    """``BlockedBF16``: a row's result is the same in a forward of 1 prompt row or 300, at any
    place among them (oneDNN's bf16 products over all rows at once do not promise that)."""
    gen = torch.Generator().manual_seed(0)
    kernel = BlockedBF16()
    for out_f, in_f in ((576, 1536), (1536, 576), (960, 576), (192, 576)):  # SmolLM2's shapes
        weight = torch.randn(out_f, in_f, generator=gen) * 0.05
        prepared = kernel.prepare(weight)
        rows = torch.randn(3 * PROMPT_BLOCK + 7, in_f, generator=gen)
        every = kernel.apply(rows, prepared, None)
        assert every.dtype == torch.float32 and every.shape == (rows.shape[0], out_f)
        for start, count in (
            (0, 1),
            (5, 1),
            (0, PROMPT_BLOCK),
            (3, PROMPT_BLOCK + 1),
            (11, 2 * PROMPT_BLOCK - 9),
        ):
            part = kernel.apply(rows[start : start + count], prepared, None)
            assert torch.equal(part, every[start : start + count]), (out_f, in_f, start, count)
        # blocks of a whole number of 64-row blocks, the probe's largest (192 on an AMX Xeon)
        assert prepared[1] % PROMPT_BLOCK == 0 and PROMPT_BLOCK <= prepared[1] <= PROMPT_BLOCK_MAX
        # and it is the bf16 product of the rows, within bf16 rounding
        ref = torch.nn.functional.linear(rows.bfloat16().float(), weight.bfloat16().float())
        assert float((every - ref).norm() / ref.norm()) < 0.01


def test_prompt_dtype_setting(
    monkeypatch: pytest.MonkeyPatch, lively_tiny_path: Path, tmp_path: Path
) -> None:
    monkeypatch.setenv("TANDEM_INFERENCE_PROMPT_DTYPE", "fp16")
    with pytest.raises(ValidationError, match="prompt_dtype"):
        InferenceSettings()
    monkeypatch.setenv("TANDEM_INFERENCE_PROMPT_DTYPE", "float32")
    settings = InferenceSettings(model=str(lively_tiny_path), quantize="int4")
    engine = build_torch_engine(settings, CommonSettings(home=tmp_path), "tiny", str(lively_tiny_path))
    assert isinstance(engine, TorchEngine)
    assert (engine.runner.quantize, engine.runner.prompt_dtype) == ("int4", "float32")


def test_kv_dtype_setting(monkeypatch: pytest.MonkeyPatch, lively_tiny_path: Path, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_INFERENCE_KV_DTYPE", "half")
    with pytest.raises(ValidationError, match="kv_dtype"):
        InferenceSettings()
    monkeypatch.setenv("TANDEM_INFERENCE_KV_DTYPE", "float16")
    settings = InferenceSettings(model=str(lively_tiny_path))
    engine = build_torch_engine(settings, CommonSettings(home=tmp_path), "tiny", str(lively_tiny_path))
    assert isinstance(engine, TorchEngine)
    assert engine.plan.kv_dtype == "float16" and engine.runner.cache.k[0].dtype == torch.float16
    monkeypatch.delenv("TANDEM_INFERENCE_KV_DTYPE")
    plain = build_torch_engine(
        InferenceSettings(model=str(lively_tiny_path)),
        CommonSettings(home=tmp_path),
        "t",
        str(lively_tiny_path),
    )
    assert isinstance(plain, TorchEngine) and plain.runner.cache.k[0].dtype == torch.float32


def test_quantised_engine_follows_weight_updates(lively_tiny_path: Path) -> None:
    """The trainer changes weights in place between rollouts: the quantised copies follow."""
    model, tok = _load(lively_tiny_path)
    engine = TorchEngine.from_model(model, tok, max_batch_size=2, quantize="int4")
    prompt = [_chat(tok, QUESTIONS[0])]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    before = engine.generate_batch(prompt, greedy)[0].token_ids
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(-1.0)
    after = engine.generate_batch(prompt, greedy)[0].token_ids
    assert after != before


def _logits(engine: TorchEngine, prompt: list[int], adapter: str | None) -> torch.Tensor:
    """The logits after ``prompt`` with its last token as a decode token (prompt tokens use the
    unquantised weights; decode tokens the quantised ones)."""
    *head, last = prompt
    engine.runner.forward([], [PrefillRow(slot=0, token_ids=head, start=0, adapter=adapter)])
    return engine.runner.forward([DecodeRow(slot=0, token=last, position=len(head), adapter=adapter)], [])[0]


def test_lora_adapter_on_a_quantised_base(lively_tiny_path: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    adapter = make_lora_adapter(lively_tiny_path, tmp_path / "lora", seed=3)
    model, tok = _load(lively_tiny_path)
    engine = TorchEngine.from_model(model, tok, max_batch_size=4, quantize="int4")
    engine.load_adapter_sync("a", str(adapter))
    assert engine.runner.packed is not None
    # the base layers under PEFT's wrappers are quantised; the adapter's own matrices are not
    names = {
        name
        for name, m in engine.model.named_modules()
        if any(p.module is m for p in engine.runner.packed.layers)
    }
    assert any(n.endswith("q_proj.base_layer") for n in names)
    assert not any(".lora_" in n for n in names)

    prompt = _chat(tok, QUESTIONS[1])
    ref_model, _ = _load(lively_tiny_path)
    ref_base = _logits(TorchEngine.from_model(ref_model, tok, quantize="none"), prompt, None)
    ref_lora_model = PeftModel.from_pretrained(_load(lively_tiny_path)[0], str(adapter)).eval()
    with torch.inference_mode():
        ref_lora = ref_lora_model(torch.tensor([prompt])).logits[0, -1]
    quant_lora = _logits(engine, prompt, "a")
    quant_base = _logits(engine, prompt, None)
    effect = float((ref_lora - ref_base).norm())
    assert effect > 1.0, "the adapter should change the logits"
    # the quantised engine with the adapter is near the fp32 model with it, far from its own base
    assert float((quant_lora - ref_lora).norm()) < 0.3 * effect
    assert float((quant_base - ref_base).norm()) < 0.3 * effect

    # adapter and base requests sharing a batch answer as they do alone
    async def run(models: list[str | None]) -> list[list[int]]:
        async def one(i: int, name: str | None) -> list[int]:
            params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
            stream = await engine.generate(
                EngineRequest(request_id=f"r{i}", params=params, model=name, prompt_token_ids=prompt)
            )
            return [t for ev in [ev async for ev in stream] for t in ev.token_ids]

        engine.scheduler.start()
        try:
            return list(await asyncio.gather(*(one(i, m) for i, m in enumerate(models))))
        finally:
            await engine.shutdown()

    mixed = asyncio.run(run(["a", None, "a", None]))
    alone = asyncio.run(run(["a"])) + asyncio.run(run([None]))
    assert mixed[0] == mixed[2] == alone[0]
    assert mixed[1] == mixed[3] == alone[1]
    assert alone[0] != alone[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str, lively_tiny_path: Path) -> Iterator[str]:
    home = tmp_path_factory.mktemp("quant-home")
    common = CommonSettings(home=home, redis_url=redis_url, model_roots=str(home / "models"), log_json=False)
    settings = InferenceSettings(model=str(lively_tiny_path), served_model_name="tiny", quantize="int4")
    with serve_app(create_app(common, settings)) as url:
        yield url


def test_quantised_server_serves_chat_and_streams(server: str, key: str) -> None:
    client = openai.OpenAI(base_url=server + "/v1", api_key=key, max_retries=0, timeout=120)
    messages: Any = [{"role": "user", "content": "Hello there"}]
    extra = {"ignore_eos": True}
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, extra_body=extra
    )
    text = chat.choices[0].message.content
    assert text and chat.usage is not None and chat.usage.completion_tokens == 12
    again = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, extra_body=extra
    )
    assert again.choices[0].message.content == text
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True, extra_body=extra
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_settings_name_a_quantisation_that_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_INFERENCE_QUANTIZE", "int3")
    with pytest.raises(ValidationError, match="quantize"):
        InferenceSettings()
    monkeypatch.delenv("TANDEM_INFERENCE_QUANTIZE")
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert quantize_mode(InferenceSettings(), gpu) == "auto"
    assert quantize_mode(InferenceSettings(quantize="int8"), cpu) == "int8"
    with pytest.raises(ValueError, match=r"TANDEM_INFERENCE_QUANTIZE=int4: .*CPU kernel.*cuda"):
        quantize_mode(InferenceSettings(quantize="int4"), gpu)


def test_auto_quantises_only_weights_that_are_4_bit_already(
    lively: tuple[Any, Any], smollm2_path: Path
) -> None:
    model, tok = lively
    cpu = torch.device("cpu")
    head = model.get_output_embeddings()
    # random fp32 weights would lose ~8%: auto keeps them as they are
    assert quantized_linear.resolve("auto", model, head, cpu) == "none"
    assert TorchEngine.from_model(model, tok, quantize="auto").runner.quantize == "none"
    assert quantized_linear.resolve("int4", model, head, cpu) == "int4"  # asked for: given
    q4 = copy.deepcopy(model)
    with torch.no_grad():
        for m in q4.modules():
            if type(m) is torch.nn.Linear and m is not q4.get_output_embeddings():
                m.weight.copy_(_q4_1_weight(*m.weight.shape))
    assert quantized_linear.resolve("auto", q4, q4.get_output_embeddings(), cpu) == "int4"
    assert quantized_linear.resolve("auto", q4, q4.get_output_embeddings(), torch.device("cuda")) == "none"
    # the default model comes from a Q4_1 GGUF: auto serves it in int4
    smol, _ = _load(smollm2_path)
    assert quantized_linear.resolve("auto", smol, smol.get_output_embeddings(), cpu) == "int4"
