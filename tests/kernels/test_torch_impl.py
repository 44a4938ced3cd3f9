"""The torch path (and the public API) against the dense reference: outputs and gradients."""

from __future__ import annotations

import pytest
import tandem_kernels
import torch
from tandem_kernels.flashmask.bounds import normalize_bounds
from tandem_kernels.flashmask.reference import reference_attention
from tandem_kernels.flashmask.torch_impl import torch_flashmask_attention

from tests.kernels.cases import cases, compare_with_reference, qkv

HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA


SMALL_CASES = cases(77, 4, seed=3)


@pytest.mark.parametrize("engine", ["matmul", "sdpa_cpu"])
@pytest.mark.parametrize(
    "case,hq,hk",
    [(c, 4, 2) for c in SMALL_CASES]  # every mask kind with GQA
    + [(c, hq, hk) for c in SMALL_CASES[2::3] for hq, hk in HEADS if hk != 2],  # some with MHA and MQA
    ids=lambda x: x.name if hasattr(x, "name") else str(x),
)
def test_small_tiles_fp32(case, hq, hk, engine) -> None:  # type: ignore[no-untyped-def]
    """Odd size with 16-row/8-column tiles, so skipped, partial and full tiles all occur; a tiny
    budget forces runs to split too."""
    q, k, v = qkv(2, 77, hq, hk, 16, torch.float32, seed=hq + hk)
    bounds = normalize_bounds(case.mask, causal=case.causal, batch=2, sq=77, sk=77, device=q.device)
    out = torch_flashmask_attention(
        q,
        k,
        v,
        bounds,
        16**-0.5,
        causal=case.causal,
        block_q=16,
        block_k=8,
        budget=2 * 4 * 16 * 16,
        engine=engine,
    )
    compare_with_reference(out, q, k, v, case, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", cases(300, 4, seed=5), ids=lambda c: c.name)
def test_public_api_default_tiles(case, dtype) -> None:  # type: ignore[no-untyped-def]
    q, k, v = qkv(1, 300, 4, 2, 32, dtype, seed=7)
    out = tandem_kernels.flashmask_attention(q, k, v, case.mask, causal=case.causal, impl="torch")
    compare_with_reference(out, q, k, v, case, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["document", "random-c4-per-head", "prefix-lm"])
def test_matmul_engine_half_precision(name, dtype) -> None:  # type: ignore[no-untyped-def]
    case = {c.name: c for c in cases(300, 4, seed=5)}[name]
    q, k, v = qkv(1, 300, 4, 2, 32, dtype, seed=8)
    bounds = normalize_bounds(case.mask, causal=case.causal, batch=1, sq=300, sk=300, device=q.device)
    out = torch_flashmask_attention(q, k, v, bounds, 32**-0.5, causal=case.causal, engine="matmul")
    compare_with_reference(out, q, k, v, case, dtype)


def test_fully_masked_rows_are_zero_not_nan() -> None:
    s = 40
    # C=4 masking every row of every column: nothing is visible at all.
    mask = torch.tensor([0, s, 0, 0], dtype=torch.int32).expand(1, 1, s, 4).contiguous()
    q, k, v = qkv(1, s, 2, 2, 8, torch.float32)
    for impl in ("torch", "reference"):
        out = tandem_kernels.flashmask_attention(q, k, v, mask, causal=False, impl=impl)
        assert torch.equal(out, torch.zeros_like(out))
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_one_token_and_unequal_lengths() -> None:
    q, k, v = qkv(1, 1, 2, 1, 8, torch.float32)
    out = tandem_kernels.flashmask_attention(q, k, v, impl="torch")
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=2))  # the only key is itself
    # cross attention shapes (Sq != Sk), non-causal with a mask over the keys
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 2, 8, generator=gen)
    k = torch.randn(2, 20, 2, 8, generator=gen)
    v = torch.randn(2, 20, 2, 8, generator=gen)
    mask = torch.stack([torch.randint(0, 10, (2, 1, 20)), torch.randint(0, 10, (2, 1, 20))], -1).int()
    out = tandem_kernels.flashmask_attention(q, k, v, mask, causal=False, impl="torch")
    ref = reference_attention(q, k, v, mask, causal=False)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_softmax_scale_and_auto_on_cpu() -> None:
    q, k, v = qkv(1, 33, 2, 2, 8, torch.float32)
    mask = tandem_kernels.document_mask([10, 23])
    assert tandem_kernels.choose_impl(q) == "torch"
    out = tandem_kernels.flashmask_attention(q, k, v, mask, softmax_scale=0.3)
    ref = reference_attention(q, k, v, mask, softmax_scale=0.3)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"mask": torch.zeros(1, 1, 5, 1, dtype=torch.int32)}, "key columns"),
        ({"mask": torch.zeros(1, 3, 8, 1, dtype=torch.int32)}, "heads"),
        ({"mask": torch.zeros(1, 1, 8, 4, dtype=torch.int32)}, "C=4"),
        ({"mask": torch.zeros(1, 1, 8, 1)}, "integer"),
        ({"mask": None, "impl": "cuda"}, "impl"),
        ({"mask": None, "hk": 4}, "multiple"),
    ],
)
def test_bad_input_names_the_value(kwargs, message) -> None:  # type: ignore[no-untyped-def]
    q = torch.randn(1, 8, 6, 4)
    k = torch.randn(1, 8, kwargs.get("hk", 2), 4)
    with pytest.raises(ValueError, match=message):
        tandem_kernels.flashmask_attention(q, k, k, kwargs["mask"], impl=kwargs.get("impl", "torch"))


def test_fully_masked_tiles_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a document mask of 4 equal samples, the torch path multiplies only the diagonal blocks."""
    import tandem_kernels.flashmask.torch_impl as ti

    calls: list[tuple[int, ...]] = []
    real = torch.matmul

    def counting(a, b):  # type: ignore[no-untyped-def]
        calls.append(tuple(b.shape))
        return real(a, b)

    monkeypatch.setattr(ti.torch, "matmul", counting)
    q, k, v = qkv(1, 256, 1, 1, 8, torch.float32)
    bounds = normalize_bounds(
        tandem_kernels.document_mask([64] * 4), causal=True, batch=1, sq=256, sk=256, device=q.device
    )
    with torch.no_grad():
        ti.flashmask_forward(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            bounds,
            1.0,
            True,
            64,
            64,
            engine="matmul",
        )
    key_cols = sum(shape[-1] for shape in calls[::2])  # q @ k^T calls: keys touched per query block
    assert key_cols == 4 * 64  # dense would be 4 * 256 (and causal-only 64+128+192+256)


SEGMENT_SHAPED = ["causal", "full", "document", "document-padded", "shared-question", "prefix-lm"]


@pytest.mark.parametrize("name", SEGMENT_SHAPED)
def test_segment_plans_cover_packing_masks_exactly(name: str) -> None:
    """Packing masks run as dense calls per segment (no elementwise mask) and match the reference."""
    from tandem_kernels.flashmask.segments import segment_plan

    case = {c.name: c for c in cases(300, 4, seed=5)}[name]
    q, k, v = qkv(2, 300, 4, 2, 16, torch.float32, seed=11)
    bounds = normalize_bounds(case.mask, causal=case.causal, batch=2, sq=300, sk=300, device=q.device)
    assert segment_plan(bounds, 300, 300) is not None
    out = torch_flashmask_attention(q, k, v, bounds, 16**-0.5, causal=case.causal, engine="segments")
    compare_with_reference(out, q, k, v, case, torch.float32)


def test_segment_plans_per_batch_row_and_merged_causal_blocks() -> None:
    """Different packs per batch row; a DPO prompt and its chosen answer form one causal call."""
    from tandem_kernels.flashmask.segments import segment_plan

    sq = tandem_kernels.shared_question_mask([(5, 3, 4), (2, 2, 2)], total_len=20)
    doc = tandem_kernels.document_mask([7, 1, 12])
    mask = torch.cat([sq, doc])
    bounds = normalize_bounds(mask, causal=True, batch=2, sq=20, sk=20, device=torch.device("cpu"))
    plans = segment_plan(bounds, 20, 20)
    assert plans is not None
    runs = [[(s.r0, s.r1, [(r.k0, r.k1, r.causal) for r in s.runs]) for s in p] for p in plans]
    assert runs[0][:2] == [(0, 8, [(0, 8, True)]), (8, 12, [(0, 5, False), (8, 12, True)])]
    assert runs[1] == [(0, 7, [(0, 7, True)]), (7, 8, [(7, 8, True)]), (8, 20, [(8, 20, True)])]
    q, k, v = qkv(2, 20, 2, 1, 8, torch.float32, seed=2)
    out = tandem_kernels.flashmask_attention(q, k, v, mask, impl="torch")
    ref = reference_attention(q, k, v, mask)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, r, atol=5e-5, rtol=1e-4)


def test_unstructured_masks_fall_back_to_tiles() -> None:
    from tandem_kernels.flashmask.segments import segment_plan

    case = {c.name: c for c in cases(300, 4, seed=5)}["random-c4"]
    bounds = normalize_bounds(case.mask, causal=False, batch=1, sq=300, sk=300, device=torch.device("cpu"))
    assert segment_plan(bounds, 300, 300) is None
    q, k, v = qkv(1, 300, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="segment-shaped"):
        torch_flashmask_attention(q, k, v, bounds, 0.25, engine="segments")


@pytest.mark.parametrize("name", SEGMENT_SHAPED)
def test_long_segments_are_split_into_row_chunks(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments longer than MAX_SEGMENT_ROWS run as row chunks (bounded buffers); still exact."""
    import tandem_kernels.flashmask.segments as seg

    monkeypatch.setattr(seg, "MAX_SEGMENT_ROWS", 24)
    monkeypatch.setattr(seg, "MAX_RUN_KEYS", 40)
    case = {c.name: c for c in cases(300, 4, seed=5)}[name]
    q, k, v = qkv(1, 300, 4, 2, 16, torch.float32, seed=13)
    bounds = normalize_bounds(case.mask, causal=case.causal, batch=1, sq=300, sk=300, device=q.device)
    plan = seg.segment_plan(bounds, 300, 300)
    assert plan is not None and all(s.r1 - s.r0 <= 24 for s in plan[0])
    assert all(r.k1 - r.k0 <= 40 for s in plan[0] for r in s.runs)
    out = torch_flashmask_attention(q, k, v, bounds, 16**-0.5, causal=case.causal, engine="segments")
    compare_with_reference(out, q, k, v, case, torch.float32)
