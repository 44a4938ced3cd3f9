"""The C++ decode kernels' own arithmetic (``engine/native.py``): ``decode_own`` (the decoder
layers with norms, RoPE, attention and SiLU computed by the loop), ``q4_linear`` (the layers' int4
decode products: Q4_1 groups times int8 rows, AVX512-VNNI's kernels and AVX2's giving the same
numbers) and ``q8_linear`` (the output head's decode rows in Q8_0 blocks). Not the ATen loop's last bits, so they are checked against it
within a tolerance, and for what greedy decoding needs exactly: a row's numbers are the same
alone as in any batch, LoRA rows included."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.platforms import cpu_features
from services.inference.engine import TorchEngine, native, packed_linear, quantized_linear
from services.inference.engine.fused_decode import decode_kernel
from services.inference.engine.plan import PlanSettings, plain_head, plan_for, resolve_plan
from services.inference.engine.quantized_linear import Int4Blocks, Multipliers, Q8Blocks, Q8Rows
from services.inference.engine.ragged import DecodeRow, PrefillRow
from tests.helpers.models import make_lora_adapter
from tests.inference.test_fused_decode import _load

pytestmark = pytest.mark.skipif(
    quantized_linear.available("int4", torch.device("cpu")) is not None or not native.avx2(),
    reason="needs torch's CPU int4 kernel and an AVX2 CPU",
)


@pytest.fixture(scope="module")
def built() -> None:
    """The module, built once (into torch's extension directory: later runs load it)."""
    assert native.start("on")


def _q8_weight(out_f: int, in_f: int, seed: int) -> torch.Tensor:
    """A weight whose blocks of 32 are Q8_0 values: int8 (one of them +-127) times a scale."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (out_f, in_f // 32, 32), generator=gen)
    q[..., 3] = 127 * torch.where(torch.rand(out_f, in_f // 32, generator=gen) < 0.5, -1, 1)
    scale = torch.rand(out_f, in_f // 32, generator=gen) * 0.02 + 1e-3
    return (q * scale[..., None]).reshape(out_f, in_f).float()


def test_q8_blocks_multiply_the_q8_0_values_each_row_on_its_own(built: None) -> None:
    weight = _q8_weight(100, 96, seed=0)  # 100 outputs: not whole tiles of 32
    kernel = Q8Blocks()
    prepared = kernel.prepare(weight)
    q_tiles, scale_tiles, out_f = prepared
    assert out_f == 100 and q_tiles.dtype == torch.int8 and q_tiles.shape == (4, 96, 32)
    # the blocks come back as they were (the scale found again to within an fp32 rounding)
    back = (q_tiles.float() * scale_tiles.repeat_interleave(32, dim=1)).transpose(1, 2).reshape(128, 96)
    assert torch.allclose(back[:100], weight, rtol=1e-6, atol=0)
    assert torch.equal(back[100:], torch.zeros(28, 96))
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(100)
    out = kernel.apply(x, prepared, bias)
    ref = x.double() @ weight.double().T + bias.double()
    assert out.shape == (7, 100) and out.dtype == torch.float32
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    # a row's logits alone = among 2, 3 or 7 rows, at any place, bit for bit
    for row in range(7):
        alone = kernel.apply(x[row : row + 1], prepared, bias)[0]
        assert torch.equal(alone, out[row]), row
    assert torch.equal(kernel.apply(x[2:5], prepared, bias), out[2:5])
    # a batch's leading dimensions are kept
    assert torch.equal(kernel.apply(x[:6].view(2, 3, 96), prepared, bias).view(6, 100), out[:6])


def test_q8_blocks_refuse_a_width_that_is_not_whole_blocks() -> None:
    with pytest.raises(ValueError, match="40 input features"):
        Q8Blocks().prepare(torch.randn(8, 40))


def _engine(
    path: Path,
    ops: str,
    adapter: Path | None = None,
    head: str = "auto",
    platform: Any = None,
    kv_dtype: str = "model",
) -> TorchEngine:
    """int4 decode through the C++ loop (``own``) or the Python loop (``python``, the bit-exact
    reference, with the prompt chunks' Python loop and the plain head, as without the C++
    kernels); ``head``: the head's decode kernel (``auto``: the plan's); ``kv_dtype``: the plan's
    KV cache setting (``model``: fp32 keys and values)."""
    model, tok = _load(path)
    plan = plan_for(model, platform=platform, quantize="int4", native_decode="on", kv_dtype=kv_dtype)  # type: ignore[arg-type]
    assert plan.decode == "native-own"
    if ops == "python":
        prompt = "python" if plan.prompt == "native" else plan.prompt
        plan = dataclasses.replace(plan, decode="python", prompt=prompt, head_decode=plain_head())
    if head != "auto":
        plan = dataclasses.replace(plan, head_decode=plain_head() if head == "bf16" else head)
    engine = TorchEngine.from_model(model, tok, max_batch_size=6, plan=plan)
    if adapter is not None:
        engine.load_adapter_sync("a", str(adapter))
    engine.runner.prepare_weights()
    return engine


def _head_kernel(engine: TorchEngine) -> Any:
    packed = engine.runner.packed
    assert packed is not None
    head = [p for p in packed.layers if p.module is engine.runner.lm_head]
    return head[0].kernel.decode


def _fill(engine: TorchEngine, adapter: str | None = None) -> list[int]:
    positions = []
    for slot in range(5):
        prompt = list(range(300 + 7 * slot, 330 + 5 * slot))
        name = adapter if slot % 2 else None
        engine.runner.forward([], [PrefillRow(slot=slot, token_ids=prompt, start=0, adapter=name)])
        positions.append(len(prompt))
    return positions


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("kv_dtype", ["model", "float16"])
@pytest.mark.parametrize("with_adapter", [False, True])
def test_own_operations_follow_the_python_loop(
    lively_tiny_path: Path,
    tmp_path: Path,
    built: None,
    monkeypatch: pytest.MonkeyPatch,
    with_adapter: bool,
    kv_dtype: str,
) -> None:
    adapter, name = None, None
    if with_adapter:
        # LoRA rows (odd slots) beside base rows: decode_own adds their deltas row by row
        modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        adapter, name = make_lora_adapter(lively_tiny_path, tmp_path / "lora", seed=5, modules=modules), "a"
    # float16: both loops store fp16 keys and values and widen them to fp32 to attend
    python_loop = _engine(lively_tiny_path, "python", adapter, kv_dtype=kv_dtype)
    # the own loop with the same bf16 head as the Python loop's: only the layers differ
    own = _engine(lively_tiny_path, "own", adapter, head="bf16", kv_dtype=kv_dtype)
    dtype = torch.float16 if kv_dtype == "float16" else torch.float32
    assert own.runner.cache.k[0].dtype == python_loop.runner.cache.k[0].dtype == dtype
    assert own.runner.fused is not None and own.runner.fused.native
    assert python_loop.runner.fused is not None and not python_loop.runner.fused.native
    assert type(_head_kernel(own)) is type(_head_kernel(python_loop))
    calls = []
    loop = native.decode_own()

    def counting(*args: Any) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return loop(*args)

    monkeypatch.setattr(native, "decode_own", lambda: counting)
    positions = _fill(python_loop, name)
    assert _fill(own, name) == positions
    for step in range(4):
        rows = [
            DecodeRow(
                slot=s,
                token=400 + 11 * s + step,
                position=positions[s] + step,
                adapter=name if s % 2 else None,
            )
            for s in (3, 0, 4)
        ]
        ref, out = (e.runner.forward(rows, []) for e in (python_loop, own))
        # the int4 products take bf16 inputs: a last-bit difference upstream moves a rounding
        assert _relative(out, ref) < 2e-2, (step, _relative(out, ref))
        assert torch.equal(out.argmax(-1), ref.argmax(-1))
    assert calls == [3, 3, 3, 3]
    # the keys and values written are the Python loop's (to within those roundings)
    for ref_store, store in zip(
        python_loop.runner.cache.k + python_loop.runner.cache.v,
        own.runner.cache.k + own.runner.cache.v,
        strict=True,
    ):
        assert _relative(store[:5].float(), ref_store[:5].float()) < 2e-2


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_a_16_bit_kv_cache_rounds_the_keys_and_values_it_stores(
    lively_tiny_path: Path, built: None, kv_dtype: str
) -> None:
    dtype = getattr(torch, kv_dtype)
    wide, narrow = (_engine(lively_tiny_path, "own", head="q8_0", kv_dtype=kv) for kv in ("model", kv_dtype))
    assert wide.runner.plan.kv_dtype == "float32" and narrow.runner.plan.kv_dtype == kv_dtype
    positions = _fill(wide)
    assert _fill(narrow) == positions
    cache, half = wide.runner.cache, narrow.runner.cache
    assert half.nbytes() * 2 == cache.nbytes()
    # the first layer's keys and values are the same numbers, rounded to nearest even as torch casts
    # them (the later layers' are not: their inputs attended rounded keys)
    for store, rounded in ((cache.k[0], half.k[0]), (cache.v[0], half.v[0])):
        assert torch.equal(store[:5].to(dtype), rounded[:5])
    rows = [DecodeRow(slot=s, token=500 + s, position=positions[s]) for s in range(5)]
    full, rounded_out = (e.runner.forward(rows, []) for e in (wide, narrow))
    assert not torch.equal(full, rounded_out)
    # a tiny random model is touchy: its logits move by a few hundredths, its choices do not
    assert _relative(rounded_out, full) < 5e-2 and torch.equal(rounded_out.argmax(-1), full.argmax(-1))


def test_the_kv_cache_takes_the_models_dtype_or_16_bits_where_asked(
    lively_tiny_path: Path, built: None
) -> None:
    model, tok = _load(lively_tiny_path)
    plain = resolve_plan(model, None, PlanSettings(quantize="int4", native_decode="on"))
    assert (plain.decode, plain.kv_dtype, plain.reasons["kv_dtype"]) == (
        "native-own",
        "float32",
        "the model's dtype",
    )
    asked = resolve_plan(model, None, PlanSettings(quantize="int4", native_decode="on", kv_dtype="float16"))
    assert asked.kv_dtype == "float16" and "kv_dtype=float16" in asked.line()
    assert asked.reasons["kv_dtype"].startswith("TANDEM_INFERENCE_KV_DTYPE=float16")
    assert TorchEngine.from_model(model, tok, plan=asked).runner.cache.k[0].dtype == torch.float16
    with pytest.raises(ValueError, match=r"kv_dtype='bfloat16'.*float16 model"):
        resolve_plan(model.half(), None, PlanSettings(kv_dtype="bfloat16"))
    model.float()
    # on the Hugging Face modules too: they store rounded keys and attend them widened
    reference = {
        kv: TorchEngine.from_model(
            model,
            tok,
            plan=resolve_plan(model, None, PlanSettings(forward="reference", quantize="none", kv_dtype=kv)),  # type: ignore[arg-type]
        )
        for kv in ("model", "bfloat16")
    }
    outs = {}
    for kv, engine in reference.items():
        engine.runner.forward([], [PrefillRow(slot=0, token_ids=list(range(300, 340)), start=0)])
        outs[kv] = engine.runner.forward([DecodeRow(slot=0, token=401, position=40)], [])
    assert reference["bfloat16"].runner.cache.k[0].dtype == torch.bfloat16
    assert not torch.equal(outs["bfloat16"], outs["model"])
    assert _relative(outs["bfloat16"], outs["model"]) < 5e-2
    assert torch.equal(outs["bfloat16"].argmax(-1), outs["model"].argmax(-1))


@pytest.mark.parametrize("head", ["q8_0", "q8_0-int8"])
def test_the_q8_head_follows_the_bf16_head(lively_tiny_path: Path, built: None, head: str) -> None:
    if head == "q8_0-int8" and not cpu_features().avx512_vnni:
        pytest.skip("Q8_0 times int8 rows needs AVX512-VNNI")
    python_loop, own = _engine(lively_tiny_path, "python"), _engine(lively_tiny_path, "own", head=head)
    assert isinstance(_head_kernel(own), Q8Rows if head == "q8_0-int8" else Q8Blocks)
    assert not isinstance(_head_kernel(python_loop), (Q8Blocks, Q8Rows))
    positions = _fill(python_loop)
    assert _fill(own) == positions
    rows = [DecodeRow(slot=s, token=500 + s, position=positions[s]) for s in range(5)]
    ref, out = (e.runner.forward(rows, []) for e in (python_loop, own))
    assert _relative(out, ref) < 3e-2
    # each row's token is the reference's best, or ties with it (the reference's logits are bf16)
    chosen = ref.gather(1, out.argmax(-1, keepdim=True))[:, 0]
    assert bool((chosen >= ref.max(-1).values - 0.02).all()), (out.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize(
    ("with_adapter", "kv_dtype"), [(False, "model"), (True, "model"), (True, "float16"), (False, "bfloat16")]
)
def test_a_rows_numbers_are_the_same_alone_and_in_any_batch(
    lively_tiny_path: Path, tmp_path: Path, built: None, with_adapter: bool, kv_dtype: str
) -> None:
    adapter = None
    if with_adapter:
        modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        adapter = make_lora_adapter(lively_tiny_path, tmp_path / "lora", seed=5, modules=modules)
    name = "a" if with_adapter else None
    engines = [_engine(lively_tiny_path, "own", adapter, head="q8_0", kv_dtype=kv_dtype) for _ in range(2)]
    for engine in engines:
        assert engine.runner.fused is not None and engine.runner.fused.native
        assert engine.runner.fused.lora_problem is None
    positions = _fill(engines[0], name)
    assert _fill(engines[1], name) == positions
    alone, batched = engines
    for step in range(3):
        rows = {
            s: DecodeRow(
                slot=s,
                token=600 + 13 * s + step,
                position=positions[s] + step,
                adapter=name if s % 2 else None,
            )
            for s in range(5)
        }
        together = batched.runner.forward([rows[s] for s in (4, 1, 0, 3, 2)], [])
        for index, slot in enumerate((4, 1, 0, 3, 2)):
            one = alone.runner.forward([rows[slot]], [])
            assert torch.equal(one[0], together[index]), (step, slot)
    for a, b in zip(
        alone.runner.cache.k + alone.runner.cache.v,
        batched.runner.cache.k + batched.runner.cache.v,
        strict=True,
    ):
        assert torch.equal(a[:5], b[:5])
    if with_adapter:
        # the adapter's rows are not the base model's (the check above is not of two base rows)
        base = alone.runner.forward([DecodeRow(slot=0, token=7, position=positions[0] + 3)], [])
        lora = alone.runner.forward([DecodeRow(slot=1, token=7, position=positions[1] + 3, adapter="a")], [])
        assert float((base - lora).norm()) > 1.0


def test_own_operations_need_a_head_size_they_are_built_for(lively_tiny_path: Path, built: None) -> None:
    from services.inference.engine import fused_decode

    model, tok = _load(lively_tiny_path)
    engine = TorchEngine.from_model(model, tok, quantize="int4", native_decode="on")
    assert fused_decode.own_unsupported(engine.runner.config, engine.runner.dtype) is None
    config = engine.runner.config
    before = config.head_dim
    config.head_dim = 24
    try:
        assert fused_decode.own_unsupported(config, engine.runner.dtype) == (
            "head_dim 24 is not one of [16, 32, 64, 128]"
        )
    finally:
        config.head_dim = before


def test_the_head_kernel_follows_the_setting_and_the_cpus_amx(
    lively_tiny_path: Path, built: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.common.platforms import cpu_features

    # the plan: Q8_0 times int8 rows where the CPU has AVX512-VNNI (AMX or not); without it,
    # oneDNN's bf16 head where AMX is usable, else Q8_0 times fp32 rows
    for vnni, amx, want in (
        (True, True, Q8Rows),
        (True, False, Q8Rows),
        (False, True, None),
        (False, False, Q8Blocks),
    ):
        platform = dataclasses.replace(cpu_features(), amx_usable=amx, avx512_vnni=vnni)
        engine = _engine(lively_tiny_path, "own", platform=platform)
        kernel = _head_kernel(engine)
        assert (type(kernel) if isinstance(kernel, (Q8Rows, Q8Blocks)) else None) is want, (vnni, amx)
        assert engine.plan.head_decode == {Q8Rows: "q8_0-int8", Q8Blocks: "q8_0", None: "onednn-bf16"}[want]
        assert engine.plan.reasons["head"].startswith("bf16 head" if want is None else "q8_0 head")
    assert not isinstance(_head_kernel(_engine(lively_tiny_path, "own", head="bf16")), Q8Blocks)
    # a plan made by hand may pair the Q8_0 head with the loop on ATen's operations
    assert isinstance(_head_kernel(_engine(lively_tiny_path, "python", head="q8_0")), Q8Blocks)


ONEDNN_BF16 = packed_linear.available(torch.device("cpu"), torch.bfloat16)
# the C++ prompt loop's products: bf16 blocks (where oneDNN has bf16 products), and the int4
# decode blocks times int8 rows (every AVX2 CPU)
PROMPT_KINDS = (["bfloat16"] if ONEDNN_BF16 else []) + ["int8"]
# the C++ prompt layers attend with their own kernel where the CPU has AVX-512 (the plan's prompt
# attention ``own``), else with ragged's attention as ATen calls; both are checked where both run
OWN_PROMPT_ATTENTION = cpu_features().capability == "AVX512"
PROMPT_ATTENTIONS = [True, False] if OWN_PROMPT_ATTENTION else [False]


def test_prompt_rows_take_the_decode_blocks_where_onednn_has_no_amx(
    lively_tiny_path: Path, built: None
) -> None:
    model, _ = _load(lively_tiny_path)
    for amx, bf16, want in (
        (False, True, "int8"),
        (False, False, "int8"),
        (True, True, "bfloat16"),
    ):
        platform = dataclasses.replace(cpu_features(), amx_usable=amx, amx_bf16=amx, avx512_bf16=bf16)
        plan = plan_for(model, platform=platform, quantize="int4", native_decode="on")
        assert plan.prompt_dtype == want, (amx, bf16)
        if want == "int8":
            assert (plan.layer_prompt, plan.prompt) == ("int4-q8", "native")
            assert "no AMX" in plan.reasons["prompt_dtype"]
    # without the C++ kernels there are no blocks to take: bf16 where the CPU has it, and int8 asked
    # for by name is refused with the reason
    platform = dataclasses.replace(cpu_features(), amx_usable=False, avx512_bf16=True)
    assert plan_for(model, platform=platform, quantize="int4").prompt_dtype == "bfloat16"
    with pytest.raises(ValueError, match="prompt_dtype='int8'"):
        plan_for(model, quantize="int4", prompt_dtype="int8")
    with pytest.raises(ValueError, match="prompt_dtype='int8'"):
        plan_for(model, quantize="none", prompt_dtype="int8", native_decode="on")


def _prompt_engine(
    path: Path,
    native_prompt: bool,
    adapter: Path | None = None,
    prompt_dtype: str = "bfloat16",
    own_attention: bool = OWN_PROMPT_ATTENTION,
    kv_dtype: str = "model",
) -> TorchEngine:
    model, tok = _load(path)
    plan = plan_for(model, quantize="int4", prompt_dtype=prompt_dtype, native_decode="on", kv_dtype=kv_dtype)  # type: ignore[arg-type]
    assert plan.prompt == "native"
    assert plan.attention == ("own" if OWN_PROMPT_ATTENTION else "own/invariant"), plan.reasons["attention"]
    if not native_prompt:
        plan = dataclasses.replace(plan, prompt="python", attention="own/invariant")
    elif not own_attention:  # the C++ prompt layers with ragged's attention as ATen calls
        plan = dataclasses.replace(plan, attention="own/invariant")
    engine = TorchEngine.from_model(model, tok, max_batch_size=8, plan=plan)
    if adapter is not None:
        engine.load_adapter_sync("a", str(adapter))
    engine.runner.prepare_weights()
    fused = engine.runner.fused_prompt
    assert fused is not None and fused.native == native_prompt
    assert fused.own_attention == (native_prompt and own_attention)
    return engine


@pytest.mark.parametrize("kv_dtype", ["model", "float16"])
@pytest.mark.parametrize("own_attention", PROMPT_ATTENTIONS)
@pytest.mark.parametrize("prompt_dtype", PROMPT_KINDS)
@pytest.mark.parametrize("with_adapter", [False, True])
def test_the_native_prompt_loop_follows_the_python_one_and_each_prompt_is_its_own(
    lively_tiny_path: Path,
    tmp_path: Path,
    built: None,
    monkeypatch: pytest.MonkeyPatch,
    with_adapter: bool,
    prompt_dtype: str,
    own_attention: bool,
    kv_dtype: str,
) -> None:
    adapter, name = None, None
    if with_adapter:
        modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        adapter, name = make_lora_adapter(lively_tiny_path, tmp_path / "lora", seed=9, modules=modules), "a"
    python, own = (
        _prompt_engine(lively_tiny_path, flag, adapter, prompt_dtype, own_attention, kv_dtype)
        for flag in (False, True)
    )
    if kv_dtype == "float16":
        assert own.runner.cache.k[0].dtype == python.runner.cache.k[0].dtype == torch.float16
    calls = []
    loop = native.prompt_own()

    def counting(*args: Any) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return loop(*args)

    monkeypatch.setattr(native, "prompt_own", lambda: counting)
    prompts = [list(range(300 + 11 * s, 340 + 9 * s)) for s in range(6)]
    chunks = [
        PrefillRow(slot=s, token_ids=p, start=0, adapter=name if s % 2 else None)
        for s, p in enumerate(prompts)
    ]
    # six prompts together (more than one 64-row block), and one alone
    ref, out = (e.runner.forward([], chunks[:5]) for e in (python, own))
    # int8 rows: both loops multiply with the same kernel, so what differs is the operations between
    # the products and the attention (the C++ loop's own where the CPU has AVX-512): ~1e-6 apart;
    # bf16 blocks, or keys and values stored in fp16, round those differences into the next
    # product's input
    limit = 1e-4 if prompt_dtype == "int8" and kv_dtype == "model" else 2e-2
    assert _relative(out, ref) < limit and torch.equal(out.argmax(-1), ref.argmax(-1))
    alone = [e.runner.forward([], [chunks[5]]) for e in (python, own)]
    assert _relative(alone[1], alone[0]) < 2e-2
    assert calls == [sum(len(p) for p in prompts[:5]), len(prompts[5])]
    if prompt_dtype == "int8":
        # prompt rows on the decode blocks: the two lean forwards share one prepared copy of the
        # weights, and no layer keeps a prompt side of its own
        runner = own.runner
        assert runner.fused_prompt is not None and runner.fused is not None and runner.packed is not None
        assert runner.fused_prompt.layers is runner.fused.layers
        layers = [p for p in runner.packed.layers if p.module is not runner.lm_head]
        assert layers and all(type(p.kernel) is Int4Blocks for p in layers)
    for ref_store, store in zip(
        python.runner.cache.k + python.runner.cache.v, own.runner.cache.k + own.runner.cache.v, strict=True
    ):
        assert _relative(store[:6].float(), ref_store[:6].float()) < 2e-2
    # each prompt's numbers are its own: alone, beside others, and after a cached first part
    runner = own.runner
    mine = PrefillRow(slot=6, token_ids=prompts[3], start=0, adapter=name)
    first = runner.forward([], [mine])
    among = runner.forward(
        [], [chunks[0], PrefillRow(slot=7, token_ids=prompts[3], start=0, adapter=name), chunks[2]]
    )
    assert torch.equal(among[1], first[0])
    runner.forward([], [PrefillRow(slot=0, token_ids=prompts[3][:17], start=0, adapter=name)])
    rest = runner.forward(
        [], [PrefillRow(slot=0, token_ids=prompts[3][17:], start=17, adapter=name), chunks[4]]
    )
    assert torch.equal(rest[0], first[0])
    # and their keys/values too
    for store in runner.cache.k + runner.cache.v:
        assert torch.equal(store[7, :, : len(prompts[3])], store[6, :, : len(prompts[3])])
        assert torch.equal(store[0, :, : len(prompts[3])], store[6, :, : len(prompts[3])])


@pytest.mark.parametrize("prompt_dtype", PROMPT_KINDS)
def test_the_native_prompt_loop_follows_weights_changed_in_place(
    lively_tiny_path: Path, built: None, prompt_dtype: str
) -> None:
    engines = [_prompt_engine(lively_tiny_path, flag, prompt_dtype=prompt_dtype) for flag in (False, True)]
    prompt = list(range(500, 545))
    before = [e.runner.forward([], [PrefillRow(slot=0, token_ids=prompt, start=0)]) for e in engines]
    for engine in engines:
        with torch.no_grad():
            engine.runner.decoder.layers[1].mlp.gate_proj.weight.mul_(-1.5)
            engine.runner.decoder.layers[0].self_attn.o_proj.weight.add_(0.05)
    after = [e.runner.forward([], [PrefillRow(slot=1, token_ids=prompt, start=0)]) for e in engines]
    assert _relative(after[1], before[1]) > 1e-2
    assert _relative(after[1], after[0]) < 2e-2


def _q4_1_weight(out_f: int, in_f: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight whose groups of 32 are Q4_1 values (q * scale + min, q 0..15 with 0 and 15 in
    each group), and its q."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_f, in_f // 32, 32), generator=gen)
    q[..., 0], q[..., 1] = 0, 15
    scale = torch.rand(out_f, in_f // 32, 1, generator=gen) * 0.02 + 1e-3
    low = torch.randn(out_f, in_f // 32, 1, generator=gen) * 0.05
    return (q * scale + low).reshape(out_f, in_f).float(), q.reshape(out_f, in_f)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """The q of each output and input back from the layout: per tile and pair p of quads, byte
    4c + i holds output c's input 8p + i (low nibble) and 8p + 4 + i (high)."""
    tiles, quads, _ = packed.shape
    pairs = packed.view(tiles, quads // 2, 64).tolist()
    q = torch.zeros(tiles * 16, quads * 4, dtype=torch.long)
    for t in range(tiles):
        for p in range(quads // 2):
            for c in range(16):
                for i in range(4):
                    byte = pairs[t][p][4 * c + i]
                    q[16 * t + c, 8 * p + i] = byte & 0x0F
                    q[16 * t + c, 8 * p + 4 + i] = byte >> 4
    return q


@pytest.mark.parametrize("multipliers", ["fp16", "int8"])
def test_int4_blocks_keep_the_q4_1_values_and_multiply_each_row_on_its_own(
    built: None, multipliers: Multipliers
) -> None:
    weight, q = _q4_1_weight(48, 96, seed=0)
    kernel = Int4Blocks()
    packed, scale_min = kernel.prepare(weight, multipliers)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 24, 32)
    # per tile, one super-block (3 groups padded to 8): 2 x 16 fp32 bases, 8 x 2 x 16 multipliers
    # of 2 bytes (fp16) or 1 (int8)
    assert scale_min.dtype == torch.uint8
    assert scale_min.shape == (3, 640 if multipliers == "fp16" else 384)
    held_q, scale, low = Int4Blocks.held((packed, scale_min))
    back = (held_q.view(48, 3, 32) * scale[..., None] + low[..., None]).view(48, 96)
    if multipliers == "fp16":
        # scales and minima re-derived from fp32 values: base times an fp16 multiplier, within 2^-11
        assert torch.equal(_unpack(packed), q) and torch.equal(held_q.long(), q)
        assert 0 < float((back - weight).abs().max()) < 2e-4
    else:
        # int8 multipliers round a group's scale and minimum by up to a 127th of the super-block's
        # largest: the values are quantised again, within half a held step, none clipped
        step = scale.repeat_interleave(32, dim=1)
        assert float(((back - weight).abs() - step / 2).max()) <= 1e-6
        assert float((back - weight).abs().max()) > 0
        assert bool((scale > 0).all())
    weight = back  # the products below are of the values held
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(19, 96, generator=gen)  # more rows than a pass over a tile takes (8)
    bias = torch.randn(48, generator=gen)
    out = kernel.apply(x, (packed, scale_min), bias)
    ref = x.double() @ weight.double().T + bias.double()
    assert out.shape == (19, 48) and out.dtype == torch.float32
    # the rows' int8 rounding: about 0.5%, as llama.cpp's Q4_1 x Q8_1
    assert float((out.double() - ref).norm() / ref.norm()) < 2e-2
    for row in range(19):
        assert torch.equal(kernel.apply(x[row : row + 1], (packed, scale_min), bias)[0], out[row]), row
    assert torch.equal(kernel.apply(x[5:14], (packed, scale_min), bias), out[5:14])
    assert torch.equal(kernel.apply(x[:6].view(2, 3, 96), (packed, scale_min), bias).view(6, 48), out[:6])
    # a zero row: d = 0, no division by zero
    zero = kernel.apply(torch.zeros(1, 96), (packed, scale_min), None)
    assert torch.equal(zero, torch.zeros(1, 48))


def test_int4_blocks_take_fp16_multipliers_only_where_int8_ones_would_lose_values() -> None:
    groups = 96 // 32
    # a float model's weight: no multiplier holds its scales; int8 ones, 4.75 bits a weight
    _packed, blob = Int4Blocks().prepare(torch.randn(48, 96, generator=torch.Generator().manual_seed(4)))
    assert quantized_linear.blob_multipliers(blob, groups) == "int8" and blob.shape == (3, 384)
    # a Q4_1 file's values served from a folder: fp16 scales and minima, which int8 would round
    weight, q = _q4_1_weight(48, 96, seed=5)
    in_groups = weight.view(48, groups, 32)
    scale = ((in_groups.amax(-1) - in_groups.amin(-1)) / 15).half().float()
    low = in_groups.amin(-1).half().float()
    fp16_weight = (q.view(48, groups, 32) * scale[..., None] + low[..., None]).view(48, 96)
    prepared = Int4Blocks().prepare(fp16_weight)
    assert quantized_linear.blob_multipliers(prepared[1], groups) == "fp16"
    held_q, held_scale, held_low = Int4Blocks.held(prepared)
    back = (held_q.view(48, groups, 32) * held_scale[..., None] + held_low[..., None]).view(48, 96)
    assert torch.equal(back, fp16_weight)


@pytest.mark.skipif(not cpu_features().avx512_vnni, reason="compares AVX512-VNNI's kernels with AVX2's")
def test_the_avx2_kernels_give_the_vnni_kernels_numbers_bit_for_bit(built: None) -> None:
    kernel = native.q4_linear()
    gen = torch.Generator().manual_seed(2)
    for (out_f, in_f), multipliers in itertools.product(((48, 96), (160, 576)), ("fp16", "int8")):
        packed, scale_min = Int4Blocks().prepare(torch.randn(out_f, in_f, generator=gen), multipliers)
        for rows in (1, 3, 4, 5, 8, 9, 17, 32, 45):
            x = torch.randn(rows, in_f, generator=gen) * torch.rand(rows, 1, generator=gen) * 10
            wide = kernel(x, packed, scale_min, wide=True)
            assert torch.equal(wide, kernel(x, packed, scale_min, wide=False)), (out_f, multipliers, rows)
            assert torch.equal(wide, kernel(x, packed, scale_min)), (out_f, rows)


@pytest.mark.skipif(not cpu_features().avx512_vnni, reason="Q8_0 times int8 rows needs AVX512-VNNI")
def test_q8_rows_keep_a_q8_0_files_values_and_multiply_each_row_on_its_own(built: None) -> None:
    gen = torch.Generator().manual_seed(3)
    # Q8_0 as a file stores it: an fp16 scale a block of 32, int8 values reaching +-127
    q = torch.randint(-127, 128, (40, 9, 32), generator=gen)
    q[..., 0] = 127
    d = (torch.rand(40, 9, 1, generator=gen) * 0.01 + 1e-4).half().float()
    weight = (q * d).view(40, 288)
    kernel = Q8Rows()
    packed, blob, out_f = kernel.prepare(weight)
    assert out_f == 40 and packed.shape == (3, 72, 64) and blob.shape == (3, 2 * 640)
    # the values back exactly: byte 4c + i of quad j is output c's input 4j + i, as q + 128
    held_q = (packed.view(3, 72, 16, 4).permute(0, 2, 1, 3).reshape(48, 288).long() - 128)[:40]
    assert torch.equal(held_q, q.view(40, 288))
    assert torch.equal(Q8Rows.held((packed, blob, out_f)), weight)
    x = torch.randn(11, 288, generator=gen)
    out = kernel.apply(x, (packed, blob, out_f), None)
    ref = x.double() @ weight.double().T
    assert out.shape == (11, 40)
    # the rows' int8 rounding, as llama.cpp's Q8_0 x Q8_0
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2
    for row in range(11):
        assert torch.equal(kernel.apply(x[row : row + 1], (packed, blob, out_f), None)[0], out[row]), row


def test_int4_blocks_refuse_a_weight_that_is_not_whole_tiles() -> None:
    with pytest.raises(ValueError, match="40 x 64 weight"):
        Int4Blocks().prepare(torch.randn(40, 64))


def test_the_plan_takes_the_own_int4_kernel_where_the_module_is_built(
    lively_tiny_path: Path, built: None
) -> None:
    for vnni in (True, False):
        model, tok = _load(lively_tiny_path)
        platform = dataclasses.replace(cpu_features(), avx512_vnni=vnni)
        plan = plan_for(model, platform=platform, quantize="int4", native_decode="on")
        assert plan.layer_decode == "int4-q8", plan.line()
        assert f"Q4_1 x int8 rows (C++, {'AVX512-VNNI' if vnni else 'AVX2'})" in plan.reasons["layers"]
        engine = TorchEngine.from_model(model, tok, max_batch_size=2, plan=plan)
        assert type(decode_kernel(engine.runner)) is Int4Blocks
    # without the module: torch's int4 kernel, named with the reason
    model, _ = _load(lively_tiny_path)
    plan = plan_for(model, quantize="int4", native_decode="off")
    assert plan.layer_decode == "int4" and "torch's kernel" in plan.reasons["layers"]


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = Path(_get_build_directory(native._module_name(), verbose=False)) / "lock"
    lock.touch()
    made = lock.stat().st_mtime
    # a build in progress (a minute old): kept
    assert not native.clear_stale_lock(now=made + 60)
    assert lock.exists()
    # older than any build takes: removed
    assert native.clear_stale_lock(now=made + native.STALE_BUILD_S + 1)
    assert not lock.exists()
    assert not native.clear_stale_lock(now=made + native.STALE_BUILD_S + 1)
