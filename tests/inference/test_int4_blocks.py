"""The engine's own int4 decode product (``quantized_linear.Int4Blocks``, the native module's
``q4_linear``): GGUF's Q4_1 values exactly, each row's inputs as int8 in groups of 32, a row's
numbers the same alone as in any batch, and the same with AVX512-VNNI's kernels as with AVX2's;
and the plan that picks it where the module is built."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from services.common.platforms import cpu_features
from services.inference.engine import TorchEngine, native, quantized_linear
from services.inference.engine.fused_decode import decode_kernel
from services.inference.engine.plan import plan_for
from services.inference.engine.quantized_linear import Int4Blocks
from tests.inference.test_fused_decode import _load

pytestmark = pytest.mark.skipif(
    quantized_linear.available("int4", torch.device("cpu")) is not None or not native.avx2(),
    reason="needs torch's CPU int4 kernel and an AVX2 CPU",
)


@pytest.fixture(scope="module")
def built() -> None:
    assert native.start("on")


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
    """The q of each output and input back from the layout (tile, quad, byte 2c + h)."""
    tiles, quads, _ = packed.shape
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(tiles, quads, 16, 2, 2)
    return nibbles.permute(0, 2, 1, 3, 4).reshape(tiles * 16, quads * 4).long()


def test_int4_blocks_keep_the_q4_1_values_and_multiply_each_row_on_its_own(built: None) -> None:
    weight, q = _q4_1_weight(48, 96, seed=0)
    kernel = Int4Blocks()
    packed, scale_min = kernel.prepare(weight)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 24, 32)
    assert scale_min.dtype == torch.float32 and scale_min.shape == (3, 3, 2, 16)
    assert torch.equal(_unpack(packed), q)
    # scale and min per group, fp32: the weight back to within fp32 rounding
    scale = scale_min[:, :, 0].permute(0, 2, 1).reshape(48, 3)
    low = scale_min[:, :, 1].permute(0, 2, 1).reshape(48, 3)
    back = (q.view(48, 3, 32) * scale[..., None] + low[..., None]).view(48, 96)
    assert torch.allclose(back, weight, rtol=0, atol=1e-6)
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


@pytest.mark.skipif(not cpu_features().avx512_vnni, reason="compares AVX512-VNNI's kernels with AVX2's")
def test_the_avx2_kernels_give_the_vnni_kernels_numbers_bit_for_bit(built: None) -> None:
    kernel = native.q4_linear()
    gen = torch.Generator().manual_seed(2)
    for out_f, in_f in ((48, 96), (160, 576)):
        packed, scale_min = Int4Blocks().prepare(torch.randn(out_f, in_f, generator=gen))
        for rows in (1, 3, 4, 5, 8, 9, 17):
            x = torch.randn(rows, in_f, generator=gen) * torch.rand(rows, 1, generator=gen) * 10
            wide = kernel(x, packed, scale_min, wide=True)
            assert torch.equal(wide, kernel(x, packed, scale_min, wide=False)), (out_f, rows)
            assert torch.equal(wide, kernel(x, packed, scale_min)), (out_f, rows)


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
