"""Blockwise FlashMask attention in plain torch (any device; the CPU path of the trainer).

Queries are processed in blocks of ``block_q`` rows. For each block only the key tiles
that are not fully masked are visited, grouped into runs of neighbouring tiles so that
one matmul covers many keys; the elementwise mask is built only for *partial* tiles
(fully visible tiles get no mask work). Softmax is online (running max and sum), so
nothing of size ``Sq x Sk`` ever exists: the largest temporary is one run of scores,
``B * Hq * block_q * run_width`` floats, capped by ``budget``.

The backward (a ``torch.autograd.Function``) recomputes the scores of each run from
``q``, ``k`` and the saved log-sum-exp, FlashAttention-2 style, and accumulates
``dK``/``dV`` in fp32; memory stays ``O(S * tile)`` and the result is deterministic.
Half-precision inputs are computed in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels.flashmask.bounds import PARTIAL, SKIP, masked_tile, shared_tile_classes

DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 128
# Largest score chunk (elements) one step may hold; ~16 MiB in fp32.
DEFAULT_BUDGET = 4 * 1024 * 1024


@dataclass(frozen=True)
class _Run:
    k0: int
    k1: int
    partial: tuple[tuple[int, int], ...]  # key ranges of partial tiles inside [k0, k1)


def _plan(
    bounds: torch.Tensor, sq: int, sk: int, block_q: int, block_k: int, max_width: int
) -> list[list[_Run]]:
    """For each query block, the runs of key tiles to visit (skipped tiles left out)."""
    classes = shared_tile_classes(bounds, sq, block_q, block_k).tolist()
    plan: list[list[_Run]] = []
    for row in classes:
        runs: list[_Run] = []
        start = -1
        partial: list[tuple[int, int]] = []
        for kb, cls in enumerate([*row, SKIP]):
            k0 = kb * block_k
            if start >= 0 and (cls == SKIP or k0 - start >= max_width):
                runs.append(_Run(start, min(k0, sk), tuple(partial)))
                start, partial = -1, []
            if cls != SKIP:
                if start < 0:
                    start = k0
                if cls == PARTIAL:
                    partial.append((k0, min(k0 + block_k, sk)))
        plan.append(runs)
    return plan


def _mask_run(s: torch.Tensor, bounds: torch.Tensor, run: _Run, i0: int, i1: int) -> None:
    """Set the masked entries of the partial tiles of ``s [B, Hq, L, W]`` to -inf, in place."""
    for t0, t1 in run.partial:
        masked = masked_tile(bounds[:, :, t0:t1], i0, i1)
        s[..., t0 - run.k0 : t1 - run.k0].masked_fill_(masked, float("-inf"))


def _setup(
    q: torch.Tensor, k: torch.Tensor, block_q: int, block_k: int, budget: int
) -> tuple[int, int, int, int, int, int]:
    b, hq, sq, _ = q.shape
    hk, sk = k.shape[1], k.shape[2]
    width = max(block_k, (budget // max(1, b * hq * block_q)) // block_k * block_k)
    return b, hq, hk, sq, sk, width


def flashmask_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    budget: int = DEFAULT_BUDGET,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, Hq, Sq, D]``, ``k``/``v`` ``[B, Hk, Sk, D*]`` (any strides) -> (out ``[B, Hq, Sq, Dv]``
    in q's dtype, lse ``[B, Hq, Sq]`` fp32, +inf on rows that see no key)."""
    b, hq, hk, sq, sk, width = _setup(q, k, block_q, block_k, budget)
    g = hq // hk
    dv = v.shape[-1]
    plan = _plan(bounds, sq, sk, block_q, block_k, width)
    out = torch.empty(b, hq, sq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    for qi, runs in enumerate(plan):
        i0, i1 = qi * block_q, min((qi + 1) * block_q, sq)
        n = i1 - i0
        # GQA without repeating K/V: the G query heads of a KV head are stacked along rows.
        qb = q[:, :, i0:i1].float().reshape(b, hk, g * n, -1)
        m = torch.full((b, hk, g * n), float("-inf"), device=q.device)
        l_sum = torch.zeros(b, hk, g * n, device=q.device)
        acc = torch.zeros(b, hk, g * n, dv, device=q.device)
        for run in runs:
            kb = k[:, :, run.k0 : run.k1].float()
            vb = v[:, :, run.k0 : run.k1].float()
            s = torch.matmul(qb, kb.transpose(-1, -2)).mul_(scale)
            if run.partial:
                _mask_run(s.view(b, hq, n, -1), bounds, run, i0, i1)
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows with nothing visible yet
            p = s.sub_(m_safe.unsqueeze(-1)).exp_()
            alpha = torch.exp(m - m_safe)
            l_sum = l_sum * alpha + p.sum(dim=-1)
            acc = acc * alpha.unsqueeze(-1) + torch.matmul(p, vb)
            m = m_new
        seen = l_sum > 0
        o = acc / torch.where(seen, l_sum, 1.0).unsqueeze(-1)
        out[:, :, i0:i1] = o.view(b, hq, n, dv).to(q.dtype)
        lse[:, :, i0:i1] = torch.where(seen, m + torch.log(torch.where(seen, l_sum, 1.0)), float("inf")).view(
            b, hq, n
        )
    return out, lse


def flashmask_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    budget: int = DEFAULT_BUDGET,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` in the layouts and dtypes of ``q``, ``k``, ``v``."""
    b, hq, hk, sq, sk, width = _setup(q, k, block_q, block_k, budget)
    g = hq // hk
    plan = _plan(bounds, sq, sk, block_q, block_k, width)
    delta = (do.float() * out.float()).sum(dim=-1)  # rowsum(dO * O), [B, Hq, Sq]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for qi, runs in enumerate(plan):
        i0, i1 = qi * block_q, min((qi + 1) * block_q, sq)
        n = i1 - i0
        qb = q[:, :, i0:i1].float().reshape(b, hk, g * n, -1)
        dob = do[:, :, i0:i1].float().reshape(b, hk, g * n, -1)
        lse_b = lse[:, :, i0:i1].reshape(b, hk, g * n, 1)
        delta_b = delta[:, :, i0:i1].reshape(b, hk, g * n, 1)
        dqb = torch.zeros_like(qb)
        for run in runs:
            kb = k[:, :, run.k0 : run.k1].float()
            vb = v[:, :, run.k0 : run.k1].float()
            s = torch.matmul(qb, kb.transpose(-1, -2)).mul_(scale)
            if run.partial:
                _mask_run(s.view(b, hq, n, -1), bounds, run, i0, i1)
            p = s.sub_(lse_b).exp_()  # masked entries and empty rows (lse=+inf) give 0
            dv[:, :, run.k0 : run.k1] += torch.matmul(p.transpose(-1, -2), dob)
            ds = torch.matmul(dob, vb.transpose(-1, -2)).sub_(delta_b).mul_(p)
            dqb += torch.matmul(ds, kb)
            dk[:, :, run.k0 : run.k1] += torch.matmul(ds.transpose(-1, -2), qb)
        dq[:, :, i0:i1] = (dqb * scale).view(b, hq, n, -1).to(q.dtype)
    return dq, (dk * scale).to(k.dtype), dv.to(v.dtype)


class FlashMaskTorchFunction(torch.autograd.Function):
    """Autograd wrapper over the layout ``[B, S, H, D]`` used by the public API."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bounds: torch.Tensor,
        scale: float,
        block_q: int,
        block_k: int,
        budget: int,
    ) -> torch.Tensor:
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out, lse = flashmask_forward(qt, kt, vt, bounds, scale, block_q, block_k, budget)
        ctx.save_for_backward(q, k, v, out, lse, bounds)
        ctx.scale, ctx.block_q, ctx.block_k, ctx.budget = scale, block_q, block_k, budget
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad,) = grads
        q, k, v, out, lse, bounds = ctx.saved_tensors
        dq, dk, dv = flashmask_backward(
            grad.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            out,
            lse,
            bounds,
            ctx.scale,
            ctx.block_q,
            ctx.block_k,
            ctx.budget,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None, None, None, None


def torch_flashmask_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    budget: int = DEFAULT_BUDGET,
) -> torch.Tensor:
    """``[B, S, H, D]`` in and out; ``bounds`` from :func:`kernels.flashmask.bounds.normalize_bounds`."""
    out: torch.Tensor = FlashMaskTorchFunction.apply(q, k, v, bounds, scale, block_q, block_k, budget)
    return out
