"""Prepacked oneDNN linear layers: the same numbers as ``F.linear`` (to fp32 rounding),
only inside the engine's forwards, repacked when the trainer changes a weight, and the
engine's greedy output with every layer packed still equals transformers' generate."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from services.inference.engine import SamplingParams, TorchEngine, packed_linear
from services.inference.engine.packed_linear import PackedLinears

pytestmark = pytest.mark.skipif(
    not packed_linear.available(torch.device("cpu"), torch.float32),
    reason="this torch build has no oneDNN (mkldnn) packed linear",
)


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(512, 384), torch.nn.ReLU(), torch.nn.Linear(384, 256, bias=False)
    )


def test_packed_forward_matches_linear_only_inside_the_block() -> None:
    model = _model()
    packed = PackedLinears(model, batch_hint=16)
    assert len(packed.layers) == 2
    for rows in (1, 3, 16, 200):
        x = torch.randn(rows, 512)
        with torch.inference_mode():
            plain = model(x)
            with packed.active():
                fast = model(x)
        torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-4)
    assert all(p.weight is not None and p.weight[0].is_mkldnn for p in packed.layers), (
        "the packed path never ran"
    )
    # outside the block the modules are plain again: no instance forward, autograd works
    assert all("forward" not in vars(m) for m in model if isinstance(m, torch.nn.Linear))
    model(torch.randn(2, 512)).sum().backward()
    assert model[0].weight.grad is not None
    # with autograd on, even inside the block the layer computes through F.linear
    with packed.active():
        out = model(torch.randn(2, 512, requires_grad=True))
    assert out.requires_grad


def test_in_place_weight_update_is_repacked() -> None:
    model = _model()
    packed = PackedLinears(model)
    x = torch.randn(4, 512)
    with torch.inference_mode(), packed.active():
        before = model(x)
    with torch.no_grad():
        model[2].weight.mul_(-2.0)
    with torch.inference_mode():
        plain = model(x)
        with packed.active():
            after = model(x)
    torch.testing.assert_close(after, plain, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(after, before * -2.0, rtol=1e-4, atol=1e-4)


def test_deep_copy_and_refresh_see_plain_modules() -> None:
    model = _model()
    packed = PackedLinears(model)
    packed.pack_all()
    twin = copy.deepcopy(model)  # as the RL recipe copies its reference model
    with torch.no_grad():
        twin[0].weight.zero_()
    x = torch.randn(3, 512)
    with torch.inference_mode(), packed.active():
        # the original's packed weights are its own, not the twin's
        torch.testing.assert_close(model(x), _plain(model, x), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(_plain(twin, x), _plain(model, x))
    model.append(torch.nn.Linear(256, 300))
    packed.refresh(model)
    assert len(packed.layers) == 3


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                not packed_linear.available(torch.device("cpu"), torch.bfloat16),
                reason="oneDNN packs no bf16 weights on this CPU (no bf16 instructions): the runner never packs them",
            ),
        ),
    ],
)
def test_a_row_is_the_same_whatever_the_number_of_rows(dtype: torch.dtype) -> None:
    """Bit for bit, each row of a packed product alone and among 1-63 others. oneDNN's
    lone-row path differs in the last bits for some shapes (SmolLM2's 1536 -> 576 down
    projection in fp32, the shape here): those layers compute a lone row as one of two."""
    layer = torch.nn.Linear(1536, 576).to(dtype)
    packed = PackedLinears(torch.nn.Sequential(layer))
    x = torch.randn(64, 1536, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode(), packed.active():
        among = layer(x)
        for rows in (1, 2, 5, 16, 63):
            assert torch.equal(layer(x[:rows]), among[:rows]), rows
        assert torch.equal(layer(x[7].view(1, 1, -1)), among[7].view(1, 1, -1))  # [T, 1, features]


def _plain(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(x)


def test_engine_with_every_layer_packed_equals_generate(lively_tiny_path: Path) -> None:
    """Every layer of the tiny model is packed, small ones too: greedy equality alone and in a
    batch, and after an in-place weight update (the trainer's case)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(lively_tiny_path)
    model = AutoModelForCausalLM.from_pretrained(lively_tiny_path, dtype=torch.float32).eval()
    engine = TorchEngine.from_model(model, tok, max_batch_size=4, prefix_cache_mb=0)
    assert engine.runner.packed is not None and len(engine.runner.packed.layers) == 2 * 7 + 1
    prompts = [list(range(200 + 9 * i, 230 + 9 * i)) for i in range(4)]

    def reference() -> list[list[int]]:
        outs = []
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)
            outs.append(out[0, len(p) :].tolist())
        return outs

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    refs = reference()
    assert [o.token_ids for o in engine.generate_batch(prompts, params)] == refs
    # the decoder layers multiply in the lean forwards' side-by-side packed products; the others
    # (the head) through their own packed weights
    lean = [f for f in (engine.runner.fused, engine.runner.fused_prompt) if f is not None]
    assert lean, "unquantised weights take the lean forwards"
    multiplied = frozenset().union(*(f.multiplied() for f in lean))
    own = [p for p in engine.runner.packed.layers if id(p.module) not in multiplied]
    assert own and all(p.weight is not None for p in own), "the packed path never ran"
    assert engine.generate_batch(prompts[2:3], params)[0].token_ids == refs[2]
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-1.5)
    refs_after = reference()
    assert refs_after != refs
    assert [o.token_ids for o in engine.generate_batch(prompts, params)] == refs_after
