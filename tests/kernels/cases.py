"""Mask cases shared by the kernel tests: every builder and random masks of each ``C``."""

from __future__ import annotations

import random
from dataclasses import dataclass

import tandem_kernels
import torch


@dataclass(frozen=True)
class Case:
    name: str
    causal: bool
    mask: torch.Tensor | None


def random_lengths(rng: random.Random, total: int) -> list[int]:
    """Random sample lengths summing to ``total``, always including a length-1 sample when room allows."""
    lens: list[int] = [1] if total > 1 else []
    left = total - sum(lens)
    while left > 0:
        n = min(left, rng.randint(1, max(1, total // 3)))
        lens.append(n)
        left -= n
    rng.shuffle(lens)
    return lens


def random_bounds(
    rng: torch.Generator, s: int, heads: int, c: int, causal: bool, batch: int = 1
) -> torch.Tensor:
    """Arbitrary (not builder-shaped) bounds, including columns that mask every row."""

    def ints(lo: torch.Tensor | int, hi: int) -> torch.Tensor:
        lo_t = torch.as_tensor(lo).expand(batch, heads, s)
        span = (hi + 1 - lo_t).clamp(min=1)
        return (lo_t + (torch.rand(batch, heads, s, generator=rng) * span).long()).clamp(max=hi)

    j = torch.arange(s)
    if causal:
        lts = ints(j, s)
        cols = [lts] if c == 1 else [lts, ints(lts, s)]
    elif c == 2:
        cols = [ints(0, s), ints(0, s)]
    else:
        lts = ints(0, s)
        uts = ints(0, s)
        cols = [lts, ints(lts, s), uts, ints(uts, s)]
    return torch.stack(cols, dim=-1).to(torch.int32)


def cases(s: int, hq: int, seed: int = 0) -> list[Case]:
    """One case per mask kind, each C, causal and not, Hm = 1 and Hm = Hq."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lens = random_lengths(rng, s)
    p = max(1, s // 4)
    c_len = max(1, (s - p) // 2)
    out = [
        Case("causal", True, None),
        Case("full", False, None),
        Case("document", True, tandem_kernels.document_mask(lens)),
        Case(
            "document-padded",
            True,
            tandem_kernels.document_mask(lens[:-1], total_len=s) if len(lens) > 1 else None,
        ),
        Case("one-sample", True, tandem_kernels.document_mask([s])),
        Case("shared-question", True, tandem_kernels.shared_question_mask([(p, c_len, s - p - c_len)])),
        Case(
            "prefix-lm",
            False,
            tandem_kernels.prefix_lm_document_mask(lens, [rng.randint(0, n) for n in lens]),
        ),
        Case("sliding-window", True, tandem_kernels.sliding_window_mask(lens, window=max(1, s // 5))),
        Case("random-c1-causal", True, random_bounds(gen, s, 1, 1, True)),
        Case("random-c2-causal", True, random_bounds(gen, s, 1, 2, True)),
        Case("random-c2", False, random_bounds(gen, s, 1, 2, False)),
        Case("random-c4", False, random_bounds(gen, s, 1, 4, False)),
        Case("random-c1-causal-per-head", True, random_bounds(gen, s, hq, 1, True)),
        Case("random-c2-causal-per-head", True, random_bounds(gen, s, hq, 2, True)),
        Case("random-c2-per-head", False, random_bounds(gen, s, hq, 2, False)),
        Case("random-c4-per-head", False, random_bounds(gen, s, hq, 4, False)),
    ]
    return out


TOLERANCES = {
    # (output atol, gradient atol) against the fp32 reference of the same (rounded) inputs
    torch.float32: (2e-5, 5e-5),
    torch.float16: (2e-3, 5e-3),
    torch.bfloat16: (1.6e-2, 4e-2),
}


def qkv(
    b: int, s: int, hq: int, hk: int, d: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=gen)
    k = torch.randn(b, s, hk, d, generator=gen)
    v = torch.randn(b, s, hk, d, generator=gen)
    return tuple(t.to(device=device, dtype=dtype).requires_grad_(True) for t in (q, k, v))  # type: ignore[return-value]


def compare_with_reference(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    case: Case,
    dtype: torch.dtype,
    grad_seed: int = 1,
) -> None:
    """Check ``out`` (computed from q, k, v) and its gradients against the fp32 dense reference."""
    from tandem_kernels.flashmask.reference import reference_attention

    out_tol, grad_tol = TOLERANCES[dtype]
    gen = torch.Generator().manual_seed(grad_seed)
    g = torch.randn(out.shape, generator=gen).to(out.device)
    grads = torch.autograd.grad(out, (q, k, v), g.to(out.dtype))
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    mask = case.mask.to(q.device) if case.mask is not None else None
    ref = reference_attention(q32, k32, v32, mask, causal=case.causal)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), g)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all(), f"{case.name}: non-finite output"
    err = (out.float() - ref).abs().max().item()
    assert err <= out_tol, f"{case.name}: output max error {err} > {out_tol}"
    for name, a, r in zip("qkv", grads, ref_grads, strict=True):
        assert torch.isfinite(a).all(), f"{case.name}: non-finite d{name}"
        scale = max(1.0, r.abs().max().item())
        gerr = (a.float() - r).abs().max().item() / scale
        assert gerr <= grad_tol, f"{case.name}: d{name} max error {gerr} > {grad_tol}"
