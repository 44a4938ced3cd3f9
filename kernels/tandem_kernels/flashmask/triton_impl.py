"""FlashMask attention in Triton: forward, backward (fused dK/dV with atomic dQ, or deterministic), GQA.

The layout is the public one, ``[B, S, H, D]`` with any strides but a unit last stride.
Before launching, :func:`tandem_kernels.flashmask.bounds.block_stats` summarises every key block
of ``BLOCK_N`` columns by the min and max of its four bounds; each program reads those
eight numbers per tile and

* skips the tile when it is fully masked (no loads, no matmuls),
* takes the fast path when it is fully visible (no per-element mask work),
* otherwise loads the block's bounds and masks element by element.

Softmax runs in base 2 (``exp2``); the saved log-sum-exp is in base 2 too and never leaves
this module. Rows that see no key get zeros and an LSE of +inf, so their ``P`` is 0 in
the backward. Head dims 64 and 128, fp32 / fp16 / bf16; :func:`supports` says when.

Backward: one program per (key block, KV head) walks the query blocks of every query head
of its group, accumulating dK and dV in registers (so GQA needs no atomics). dQ is either
added from the same program with fp32 atomics (default; fewer matmuls) or, with
``deterministic=True``, computed by a second kernel per (query block, head) that owns its
rows, which gives bit-identical results run to run.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from tandem_kernels.flashmask.bounds import block_stats

LOG2E = math.log2(math.e)
# How the kernels below were built: under TRITON_INTERPRET=1 (read by @triton.jit when this module
# is imported) they are interpreted on the CPU, otherwise compiled for the GPU.
INTERPRETED = bool(triton.knobs.runtime.interpret)
HEAD_DIMS = (64, 128)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def supports(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the Triton kernels take these inputs (else the caller falls back to torch)."""
    if q.shape[-1] not in HEAD_DIMS or v.shape[-1] != q.shape[-1] or q.dtype not in DTYPES:
        return False
    if q.device.type == "cpu":
        return INTERPRETED
    return q.device.type in ("cuda", "xpu")


@triton.jit
def _tile_class(stats_ptr, i0, i1):
    """0 = skip, 1 = partial, 2 = fully visible, for rows [i0, i1) and one key block's 8 stats."""
    min_lts = tl.load(stats_ptr + 0)
    max_lts = tl.load(stats_ptr + 1)
    min_lte = tl.load(stats_ptr + 2)
    max_lte = tl.load(stats_ptr + 3)
    min_uts = tl.load(stats_ptr + 4)
    max_uts = tl.load(stats_ptr + 5)
    min_ute = tl.load(stats_ptr + 6)
    max_ute = tl.load(stats_ptr + 7)
    skip = ((i0 >= max_lts) & (i1 <= min_lte)) | ((i0 >= max_uts) & (i1 <= min_ute))
    full = ((i1 <= min_lts) | (i0 >= max_lte)) & ((i1 <= min_uts) | (i0 >= max_ute))
    return tl.where(skip, 0, tl.where(full, 2, 1))


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    Bnd,
    Stats,
    Out,
    Lse,
    scale_log2,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_os,
    stride_oh,
    stride_bb,
    stride_bh,
    stride_tb,
    stride_th,
    Hq,
    G,
    Sq,
    Sk,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)  # batch offsets can pass 2**31 elements
    h = pid_bh % Hq
    hk = h // G
    i0 = pid_m * BLOCK_M
    i1 = tl.minimum(i0 + BLOCK_M, Sq)
    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    bnd_base = Bnd + b * stride_bb + h * stride_bh
    stats_base = Stats + b * stride_tb + h * stride_th
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    n_blocks = tl.cdiv(Sk, BLOCK_N)
    if CAUSAL:
        # key blocks starting at or after i1 lie entirely above the diagonal
        n_blocks = tl.minimum(n_blocks, tl.cdiv(tl.minimum(i1, Sk), BLOCK_N))
    for nb in range(0, n_blocks):
        cls = _tile_class(stats_base + nb * 8, i0, i1)
        if cls != 0:
            offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = offs_n < Sk
            kt = tl.load(
                K + b * stride_kb + hk * stride_kh + offs_n[None, :] * stride_ks + offs_d[:, None],
                mask=col_ok[None, :],
                other=0.0,
            )
            qk = tl.dot(q, kt, input_precision=DOT_PRECISION) * scale_log2
            qk = tl.where(col_ok[None, :], qk, float("-inf"))
            if cls == 1:
                bp = bnd_base + offs_n * 4
                lts = tl.load(bp + 0, mask=col_ok, other=0)
                lte = tl.load(bp + 1, mask=col_ok, other=0)
                uts = tl.load(bp + 2, mask=col_ok, other=0)
                ute = tl.load(bp + 3, mask=col_ok, other=0)
                rows = offs_m[:, None]
                masked = ((rows >= lts[None, :]) & (rows < lte[None, :])) | (
                    (rows >= uts[None, :]) & (rows < ute[None, :])
                )
                qk = tl.where(masked, float("-inf"), qk)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :],
                mask=col_ok[:, None],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, m_i + tl.math.log2(l_safe), float("inf"))
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None],
    )
    tl.store(Lse + pid_bh * Sq + offs_m, lse, mask=row_ok)


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    Bnd,
    Stats,
    DQ,
    DK,
    DV,
    scale,
    scale_log2,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_bb,
    stride_bh,
    stride_tb,
    stride_th,
    Hq,
    Hk,
    G,
    Sq,
    Sk,
    CAUSAL: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hk).to(tl.int64)
    hk = pid_bh % Hk
    j0 = pid_n * BLOCK_N
    offs_n = j0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < Sk
    k = tl.load(
        K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
        mask=col_ok[:, None],
        other=0.0,
    )
    v = tl.load(
        V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :],
        mask=col_ok[:, None],
        other=0.0,
    )
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    n_q_blocks = tl.cdiv(Sq, BLOCK_M)
    first = 0
    if CAUSAL:
        first = j0 // BLOCK_M  # query blocks ending at or before j0 are above the diagonal
    for g in range(0, G):
        h = hk * G + g
        bp = Bnd + b * stride_bb + h * stride_bh + offs_n * 4
        lts = tl.load(bp + 0, mask=col_ok, other=0)
        lte = tl.load(bp + 1, mask=col_ok, other=0)
        uts = tl.load(bp + 2, mask=col_ok, other=0)
        ute = tl.load(bp + 3, mask=col_ok, other=0)
        stats_ptr = Stats + b * stride_tb + h * stride_th + pid_n * 8
        for mb in range(first, n_q_blocks):
            i0 = mb * BLOCK_M
            i1 = tl.minimum(i0 + BLOCK_M, Sq)
            cls = _tile_class(stats_ptr, i0, i1)
            if cls != 0:
                offs_m = i0 + tl.arange(0, BLOCK_M)
                row_ok = offs_m < Sq
                q = tl.load(
                    Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                    mask=row_ok[:, None],
                    other=0.0,
                )
                do = tl.load(
                    DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :],
                    mask=row_ok[:, None],
                    other=0.0,
                )
                lse = tl.load(Lse + (b * Hq + h) * Sq + offs_m, mask=row_ok, other=float("inf"))
                delta = tl.load(Delta + (b * Hq + h) * Sq + offs_m, mask=row_ok, other=0.0)
                qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * scale_log2  # [N, M]
                qk_t = tl.where(col_ok[:, None], qk_t, float("-inf"))
                if cls == 1:
                    rows = offs_m[None, :]
                    masked = ((rows >= lts[:, None]) & (rows < lte[:, None])) | (
                        (rows >= uts[:, None]) & (rows < ute[:, None])
                    )
                    qk_t = tl.where(masked, float("-inf"), qk_t)
                p_t = tl.math.exp2(qk_t - lse[None, :])
                dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
                dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
                ds_t = p_t * (dp_t - delta[None, :])
                dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
                if ATOMIC_DQ:
                    dq = tl.dot(tl.trans(ds_t).to(k.dtype), k, input_precision=DOT_PRECISION) * scale
                    tl.atomic_add(
                        DQ + ((b * Sq + offs_m[:, None]) * Hq + h) * HEAD_DIM + offs_d[None, :],
                        dq,
                        mask=row_ok[:, None],
                    )
    # DK / DV are contiguous [B, Sk, Hk, D]
    dst = ((b * Sk + offs_n[:, None]) * Hk + hk) * HEAD_DIM + offs_d[None, :]
    tl.store(DK + dst, (dk * scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + dst, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    Bnd,
    Stats,
    DQ,
    scale,
    scale_log2,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_bb,
    stride_bh,
    stride_tb,
    stride_th,
    Hq,
    G,
    Sq,
    Sk,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)  # batch offsets can pass 2**31 elements
    h = pid_bh % Hq
    hk = h // G
    i0 = pid_m * BLOCK_M
    i1 = tl.minimum(i0 + BLOCK_M, Sq)
    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    lse = tl.load(Lse + pid_bh * Sq + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + pid_bh * Sq + offs_m, mask=row_ok, other=0.0)
    bnd_base = Bnd + b * stride_bb + h * stride_bh
    stats_base = Stats + b * stride_tb + h * stride_th
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    n_blocks = tl.cdiv(Sk, BLOCK_N)
    if CAUSAL:
        n_blocks = tl.minimum(n_blocks, tl.cdiv(tl.minimum(i1, Sk), BLOCK_N))
    for nb in range(0, n_blocks):
        cls = _tile_class(stats_base + nb * 8, i0, i1)
        if cls != 0:
            offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = offs_n < Sk
            kt = tl.load(
                K + b * stride_kb + hk * stride_kh + offs_n[None, :] * stride_ks + offs_d[:, None],
                mask=col_ok[None, :],
                other=0.0,
            )
            vt = tl.load(
                V + b * stride_vb + hk * stride_vh + offs_n[None, :] * stride_vs + offs_d[:, None],
                mask=col_ok[None, :],
                other=0.0,
            )
            qk = tl.dot(q, kt, input_precision=DOT_PRECISION) * scale_log2
            qk = tl.where(col_ok[None, :], qk, float("-inf"))
            if cls == 1:
                bp = bnd_base + offs_n * 4
                lts = tl.load(bp + 0, mask=col_ok, other=0)
                lte = tl.load(bp + 1, mask=col_ok, other=0)
                uts = tl.load(bp + 2, mask=col_ok, other=0)
                ute = tl.load(bp + 3, mask=col_ok, other=0)
                rows = offs_m[:, None]
                masked = ((rows >= lts[None, :]) & (rows < lte[None, :])) | (
                    (rows >= uts[None, :]) & (rows < ute[None, :])
                )
                qk = tl.where(masked, float("-inf"), qk)
            p = tl.math.exp2(qk - lse[:, None])
            dp = tl.dot(do, vt, input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=DOT_PRECISION)
    tl.store(
        DQ + ((b * Sq + offs_m[:, None]) * Hq + h) * HEAD_DIM + offs_d[None, :],
        (dq * scale).to(DQ.dtype.element_ty),
        mask=row_ok[:, None],
    )


def _blocks(d: int, dtype: torch.dtype, interpret: bool) -> dict[str, int]:
    if interpret:
        # Small tiles keep the interpreter quick and make small test shapes span several tiles.
        return {"fwd_m": 16, "fwd_n": 16, "bwd_m": 16, "bwd_n": 16, "warps": 4, "stages": 1}
    if dtype == torch.float32 and d > 64:
        # fp32 tiles of 128 x 128 need ~130-150 KB of shared memory (checked by compiling for
        # sm_90); halve the row blocks so they also fit GPUs with ~100 KB per block.
        return {"fwd_m": 64, "fwd_n": 64, "bwd_m": 32, "bwd_n": 64, "warps": 8, "stages": 2}
    if d <= 64:
        return {"fwd_m": 128, "fwd_n": 64, "bwd_m": 64, "bwd_n": 64, "warps": 4, "stages": 2}
    return {"fwd_m": 128, "fwd_n": 64, "bwd_m": 64, "bwd_n": 64, "warps": 8, "stages": 2}


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _mask_strides(t: torch.Tensor) -> tuple[int, int]:
    """Batch and head strides, 0 where the mask is shared (size-1 dim)."""
    return (t.stride(0) if t.shape[0] > 1 else 0, t.stride(1) if t.shape[1] > 1 else 0)


def _precision(dtype: torch.dtype) -> str | None:
    # fp32 inputs get true fp32 products (no TF32), so the fp32 path matches the reference closely;
    # half types use the backend's default.
    return "ieee" if dtype == torch.float32 else None


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    interpret = q.device.type == "cpu"
    cfg = _blocks(d, q.dtype, interpret)
    stats = block_stats(bounds, cfg["fwd_n"])
    out = torch.empty(b, sq, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(sq, cfg["fwd_m"]), b * hq)
    _fwd_kernel[grid](
        q,
        k,
        v,
        bounds,
        stats,
        out,
        lse,
        scale * LOG2E,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *out.stride()[:3],
        *_mask_strides(bounds),
        *_mask_strides(stats),
        hq,
        hq // hk,
        sq,
        sk,
        CAUSAL=causal,
        HEAD_DIM=d,
        BLOCK_M=cfg["fwd_m"],
        BLOCK_N=cfg["fwd_n"],
        DOT_PRECISION=_precision(q.dtype),
        num_warps=cfg["warps"],
        num_stages=cfg["stages"],
    )
    return out, lse


def _backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    causal: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    interpret = q.device.type == "cpu"
    cfg = _blocks(d, q.dtype, interpret)
    do = _unit_last(do)
    # rowsum(dO * O), laid out [B, Hq, Sq] like the LSE
    delta = (do.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    stats = block_stats(bounds, cfg["bwd_n"])
    dk = torch.empty(b, sk, hk, d, dtype=k.dtype, device=k.device)
    dv = torch.empty(b, sk, hk, d, dtype=v.dtype, device=v.device)
    dq_acc = (
        torch.zeros(b, sq, hq, d, dtype=torch.float32, device=q.device)
        if not deterministic
        else torch.empty(b, sq, hq, d, dtype=q.dtype, device=q.device)
    )
    common: dict[str, Any] = {
        "CAUSAL": causal,
        "HEAD_DIM": d,
        "BLOCK_M": cfg["bwd_m"],
        "BLOCK_N": cfg["bwd_n"],
        "DOT_PRECISION": _precision(q.dtype),
        "num_warps": cfg["warps"],
        "num_stages": cfg["stages"],
    }
    strides = (
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *do.stride()[:3],
        *_mask_strides(bounds),
        *_mask_strides(stats),
    )
    _bwd_dkdv_kernel[(triton.cdiv(sk, cfg["bwd_n"]), b * hk)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        bounds,
        stats,
        dq_acc,
        dk,
        dv,
        scale,
        scale * LOG2E,
        *strides,
        hq,
        hk,
        hq // hk,
        sq,
        sk,
        ATOMIC_DQ=not deterministic,
        **common,
    )
    if deterministic:
        _bwd_dq_kernel[(triton.cdiv(sq, cfg["bwd_m"]), b * hq)](
            q,
            k,
            v,
            do,
            lse,
            delta,
            bounds,
            stats,
            dq_acc,
            scale,
            scale * LOG2E,
            *strides,
            hq,
            hq // hk,
            sq,
            sk,
            **common,
        )
        return dq_acc, dk, dv
    return dq_acc.to(q.dtype), dk, dv


class FlashMaskTritonFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bounds: torch.Tensor,
        scale: float,
        causal: bool,
        deterministic: bool,
    ) -> torch.Tensor:
        q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
        out, lse = _forward(q, k, v, bounds, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse, bounds)
        ctx.scale, ctx.causal, ctx.deterministic = scale, causal, deterministic
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, bounds = ctx.saved_tensors
        dq, dk, dv = _backward(grads[0], q, k, v, out, lse, bounds, ctx.scale, ctx.causal, ctx.deterministic)
        return dq, dk, dv, None, None, None, None


def triton_flashmask_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    *,
    causal_hint: bool = False,
    deterministic: bool = False,
) -> torch.Tensor:
    """``[B, S, H, D]`` in and out; ``bounds`` from :func:`tandem_kernels.flashmask.bounds.normalize_bounds`.

    ``causal_hint`` only bounds the loops (the causal triangle is already in ``bounds``); pass
    it when the attention is causal so that blocks above the diagonal are not even visited.
    """
    out: torch.Tensor = FlashMaskTritonFunction.apply(q, k, v, bounds, scale, causal_hint, deterministic)
    return out
