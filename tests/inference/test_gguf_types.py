"""GGUF files in the quantisation types people download (F16, Q8_0, Q4_0, Q4_1, Q4_K_M, Q5_K_M,
Q6_K), written with the ``gguf`` package's writer from a tiny random Llama: the loader keeps every
value of the file (de-quantised to fp32), the int4 kernels hold the file's own 4-bit groups where
its type is Q4_0 / Q4_1 / Q4_K (bit for bit, in each layer and in the lean forward's side-by-side
products), other types are re-quantised only where int4 decode is on (within a stated tolerance),
greedy output matches the de-quantised model's reference forward, and a file of a type the engine
does not load is refused naming the type."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from services.inference.engine import SamplingParams, TorchEngine, gguf_weights, quantized_linear
from services.inference.engine.loader import resolve_model
from services.inference.engine.quantized_linear import Int4Blocks
from tests.helpers.gguf_files import MIXES, write_llama_gguf

pytestmark = pytest.mark.skipif(
    quantized_linear.available("int4", torch.device("cpu")) is not None,
    reason="this torch build has no CPU weight-only int4 kernel",
)

# hidden and intermediate sizes are whole 256-value super-blocks, so the K-quants apply
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 1024
# the tiny models' shape, whatever their architecture
SIZES: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# a random fp32 weight (or a 5/6/8-bit one) re-quantised to int4 groups of 32 loses about 8%
REQUANTISED_INT4 = 0.10
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@cache
def _tiny_model() -> Any:
    """A tiny Llama with weights large enough that greedy decoding wanders through the vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SIZES, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "embed" in name else 0.15))
    return model.eval()


class Files:
    """The tiny model written once in each file type, resolved by the loader when asked for (as
    an engine's start-up resolves its one model: the loader registers the file's groups then)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.types: dict[str, dict[str, str]] = {}

    def __getitem__(self, mix: str) -> tuple[Path, Path, dict[str, str]]:
        path = self.root / f"tiny-{mix}.gguf"
        if mix not in self.types:
            self.types[mix] = write_llama_gguf(_tiny_model(), path, mix)
        return path, resolve_model(path, self.root / "cache"), self.types[mix]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return Files(tmp_path_factory.mktemp("gguf-types"))


def _load(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _file_values(path: Path) -> dict[str, torch.Tensor]:
    """Each 2-D tensor of the file de-quantised by ``gguf`` itself, q/k rows back in transformers'
    order (llama.cpp's converter reorders them for its RoPE layout)."""
    import gguf

    out = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        if len(tensor.shape) != 2:
            continue
        rows, columns = int(tensor.shape[1]), int(tensor.shape[0])
        w = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(rows, columns)
        heads = HEADS if "attn_q" in tensor.name else KV_HEADS if "attn_k" in tensor.name else 0
        if heads:
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, columns).swapaxes(1, 2).reshape(rows, columns)
        out[tensor.name] = torch.from_numpy(np.ascontiguousarray(w))
    return out


def _gguf_name(layer: int, projection: str) -> str:
    names = dict(
        zip(
            PROJECTIONS,
            ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"),
            strict=True,
        )
    )
    return f"blk.{layer}.{names[projection]}.weight"


def _held_by_int4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, quantized_linear.Multipliers]:
    """The weight ``Int4Blocks`` holds for ``weight``: its packed 4-bit values times its scales
    (fp32 bases times multipliers) plus its minima, unpacked from the kernel's layout; and the
    multipliers it holds them with."""
    prepared = Int4Blocks().prepare(weight)
    groups = weight.shape[1] // quantized_linear.INT4_GROUP
    return gguf_weights.values(*Int4Blocks.held(prepared)), quantized_linear.blob_multipliers(
        prepared[1], groups
    )


@pytest.mark.parametrize("mix", list(MIXES))
def test_the_int4_kernel_holds_the_files_values_where_its_format_can(files: Files, mix: str) -> None:
    path, folder, types = files[mix]
    expected_types = {"Q4_K_M": {"Q4_K", "Q6_K"}, "Q5_K_M": {"Q5_K", "Q6_K"}}.get(mix, {MIXES[mix][0]})
    assert {t for n, t in types.items() if n.startswith("blk.") and "norm" not in n} == expected_types
    model = _load(folder)
    file = _file_values(path)
    for i, layer in enumerate(model.model.layers):
        side_by_side = []
        for projection in PROJECTIONS:
            module = getattr(
                layer.self_attn
                if projection.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                else layer.mlp,
                projection,
            )
            weight, name = module.weight.detach(), _gguf_name(i, projection)
            # the loader keeps every value of the file, whatever its type
            assert torch.equal(weight, file[name]), name
            q, scale, low = quantized_linear.q4_1_groups(weight)
            held = (q * scale[..., None] + low[..., None]).view(weight.shape)
            if types[name] in gguf_weights.INT4_TYPES:
                # the file's groups, bit for bit, in the kernel's own layout too
                assert torch.equal(held, file[name]), name
                held_by_blocks, multipliers = _held_by_int4_blocks(weight)
                assert torch.equal(held_by_blocks, file[name]), name
                # Q4_K's 6-bit scales and minima in one byte each (4.75 bits a weight); Q4_0's and
                # Q4_1's fp16 ones need two (5.25)
                assert multipliers == ("int8" if types[name] == "Q4_K" else "fp16"), name
            else:
                # no int4 kernel holds 5/6/8/16-bit values: re-quantised where int4 decode is on
                error = float((held - weight).norm() / weight.norm())
                assert 0 < error <= REQUANTISED_INT4, (name, error)
            if projection in ("q_proj", "k_proj", "v_proj"):
                side_by_side.append(weight)
        # the lean forward multiplies q/k/v side by side: their rows keep the file's groups there
        qkv = torch.cat(side_by_side)
        q, scale, low = quantized_linear.q4_1_groups(qkv)
        rows = [file[_gguf_name(i, p)] for p in ("q_proj", "k_proj", "v_proj")]
        exact = [types[_gguf_name(i, p)] in gguf_weights.INT4_TYPES for p in ("q_proj", "k_proj", "v_proj")]
        held_rows = (q * scale[..., None] + low[..., None]).view(qkv.shape).split([r.shape[0] for r in rows])
        for got, want, kept in zip(held_rows, rows, exact, strict=True):
            assert torch.equal(got, want) == kept
    # auto decodes in int4 where every decoder layer holds 4-bit values, else keeps fp32
    head = model.get_output_embeddings()
    layer_types = {t for n, t in types.items() if n.startswith("blk.") and "norm" not in n}
    auto = quantized_linear.resolve("auto", model, head, torch.device("cpu"))
    assert auto == ("int4" if layer_types <= set(gguf_weights.INT4_TYPES) else "none")
    # where the CPU multiplies Q8_0 blocks times int8 rows, a Q8_0 file's layers decode in int8
    with_q8 = quantized_linear.resolve("auto", model, head, torch.device("cpu"), q8_rows=True)
    assert with_q8 == ("int4" if auto == "int4" else "int8" if layer_types == {"Q8_0"} else "none"), mix


def test_q8_rows_hold_a_q8_0_files_values(files: Files) -> None:
    path, folder, _types = files["Q8_0"]
    model, file = _load(folder), _file_values(path)
    for i, layer in enumerate(model.model.layers):
        for projection, module in (("gate_proj", layer.mlp.gate_proj), ("o_proj", layer.self_attn.o_proj)):
            held = quantized_linear.Q8Rows.held(quantized_linear.Q8Rows().prepare(module.weight))
            assert torch.equal(held, file[_gguf_name(i, projection)]), projection


def test_rows_the_trainer_changed_are_quantised_from_their_new_values(
    files: Files,
) -> None:
    _path, folder, _types = files["Q4_0"]
    weight = _load(folder).model.layers[0].mlp.up_proj.weight.detach().clone()
    weight[3] += 0.01  # one row moved off the file's values
    kept = gguf_weights.file_groups(weight)
    assert kept is not None
    found = kept[3]
    assert not bool(found[3]) and bool(found[torch.arange(weight.shape[0]) != 3].all())
    q, scale, _low = quantized_linear.q4_1_groups(weight)
    assert torch.isfinite(scale).all() and q.max() <= 15 and q.min() >= 0


def _prompts(folder: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    chats = [
        tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        for text in ("hello there", "a short question about the sea")
    ]
    return [list(c["input_ids"] if hasattr(c, "keys") else c) for c in chats] + [list(range(300, 340))]


NEW_TOKENS = 12
# how far below the reference's best logit a token an int4 plan chose may score: seen up to 1.4 on
# a CPU with AMX, where the tiny model's best token leads its median one by 21-24
NEAR_TIE = 2.0


@pytest.mark.parametrize(
    ("mix", "quantize"),
    [
        ("Q4_0", "auto"),
        ("Q4_1", "auto"),
        ("Q4_K_M", "auto"),
        ("Q4_K_M", "int4"),
        ("Q5_K_M", "auto"),
        ("Q6_K", "auto"),
        ("Q8_0", "auto"),
        ("F16", "auto"),
    ],
)
def test_greedy_tokens_match_the_dequantised_reference_forward(files: Files, mix: str, quantize: str) -> None:
    _path, folder, _types = files[mix]
    reference = _load(folder)
    prompts = _prompts(folder)
    expected = [
        reference.generate(
            torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )[0, len(p) :].tolist()
        for p in prompts
    ]
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = TorchEngine.from_pretrained(folder, quantize=quantize)
    got = [o.token_ids for o in engine.generate_batch(prompts, greedy)]
    assert len({tuple(e) for e in expected}) == len(prompts)
    if engine.runner.plan.quantize == "none":
        # the file's values in fp32: the reference forward's tokens exactly
        assert got == expected
        return
    # int4 decode multiplies rounded rows (bf16, or int8 in the C++ kernel; AMX's bf16 tiles on a
    # CPU that has them) with the file's groups (test_the_int4_kernel_holds_the_files_values_where_
    # its_format_can), so where a random model's next token is a near tie the two may part. Each
    # token the engine chose is one the reference, fed the engine's own tokens, scores within
    # NEAR_TIE of its best (a token the reference ranks far lower would be a wrong forward).
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        top = logits.max(dim=-1).values
        behind, spread = top - chosen, top - logits.median(dim=-1).values
        assert float(behind.max()) <= NEAR_TIE < float(spread.min()), (behind.tolist(), spread.min())


def test_a_type_the_engine_does_not_load_is_refused_naming_it(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tiny-IQ2_XS.gguf"
    iq2 = gguf.GGMLQuantizationType.IQ2_XS
    _block, type_size = gguf.GGML_QUANT_SIZES[iq2]

    def mix(name: str, shape: tuple[int, ...]) -> str:
        return "F32" if len(shape) == 1 else "Q8_0"

    write_llama_gguf(_tiny_model(), path, mix)
    # one tensor rewritten as IQ2_XS blocks (well-formed zeros): the writer takes raw bytes of a type
    writer = gguf.GGUFWriter(str(tmp_path / "iq2.gguf"), "llama")
    reader = gguf.GGUFReader(str(path))
    for name, field in reader.fields.items():
        if name.startswith(("tokenizer.", "llama.")):
            vtype = field.types[0]
            sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for tensor in reader.tensors:
        if tensor.name == "blk.0.ffn_up.weight":
            rows, columns = int(tensor.shape[1]), int(tensor.shape[0])
            raw = np.zeros((rows, columns // 256 * type_size), dtype=np.uint8)
            writer.add_tensor(tensor.name, raw, raw_dtype=iq2)
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cache = tmp_path / "cache"
    with pytest.raises(gguf_weights.UnsupportedGGUFType) as refused:
        resolve_model(tmp_path / "iq2.gguf", cache)
    message = str(refused.value)
    assert "IQ2_XS" in message and "blk.0.ffn_up.weight" in message
    assert all(t in message for t in ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16"))
    assert not any(cache.glob("*/config.json")), "nothing is converted"


def test_a_qwen3_gguf_loads_with_its_q_k_norms_and_unpermuted_rows(tmp_path: Path) -> None:
    """A Qwen3 file as llama.cpp's converter writes one (its own architecture keys, head size
    apart from hidden / heads, q/k norms, q/k rows in the order transformers keeps): resolved by
    the loader and served by the engine, it answers as the model it was written from."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # head_dim as Qwen3-0.6B's: 16 heads of 128 on a hidden size of 1024
    config = Qwen3Config(**SIZES, head_dim=2 * HIDDEN // HEADS, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if "embed" in name else 0.15
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if p.dim() == 1 else 0.0))
    path = tmp_path / "qwen3-F32.gguf"
    write_llama_gguf(model, path, lambda name, shape: "F32")
    folder = resolve_model(path, tmp_path / "cache")
    loaded = _load(folder)
    assert loaded.config.model_type == "qwen3" and loaded.config.head_dim == 2 * HIDDEN // HEADS
    for name, tensor in model.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(loaded.state_dict()[name], tensor), name
    prompts = [list(range(300, 330)), list(range(500, 520))]
    expected = [
        model.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[
            0, len(p) :
        ].tolist()
        for p in prompts
    ]
    engine = TorchEngine.from_pretrained(folder, quantize="none")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in engine.generate_batch(prompts, greedy)] == expected
