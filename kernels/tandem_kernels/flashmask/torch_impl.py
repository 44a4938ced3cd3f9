"""Blockwise FlashMask attention in plain torch (any device; the CPU path of the trainer).

Queries are processed in blocks of ``block_q`` rows. For each block only the key tiles
(``block_k`` columns) that are not fully masked are visited, grouped into *runs* of
neighbouring tiles of one kind: a run of fully visible tiles gets no mask at all, a run
of partial tiles gets the elementwise mask of just those tiles. A run's width is capped
so that its scores (``B * Hq * block_q * width`` floats) stay within ``budget``: nothing
of size ``Sq x Sk`` ever exists.

Runs are combined with an online softmax (running max / log-sum-exp), and the backward
(a ``torch.autograd.Function``) recomputes every run from ``q``, ``k``, ``v`` and the saved
log-sum-exp, FlashAttention-2 style, so memory stays ``O(S * tile)``.

Two interchangeable engines compute one run:

* ``matmul``: explicit matmuls and softmax in fp32, on any device;
* ``sdpa_cpu`` (the default on the CPU): torch's fused CPU flash-attention op, which
  returns the run's log-sum-exp; runs are merged through it. Its backward is called per
  run with the *global* output and log-sum-exp, which makes its ``P`` and
  ``rowsum(dO * O)`` the global ones, so the per-run gradients add up exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tandem_kernels.flashmask.bounds import FULL, SKIP, masked_tile, shared_tile_classes
from tandem_kernels.flashmask.segments import RowSegment, segment_plan

DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 128
# Largest score chunk (elements) one step may hold; 16 MiB in fp32.
DEFAULT_BUDGET = 4 * 1024 * 1024
ENGINES = ("auto", "matmul", "sdpa_cpu", "segments")

_NEG_INF = float("-inf")


FULL_RUN, PARTIAL_RUN, CAUSAL_RUN = "full", "partial", "causal"


@dataclass(frozen=True)
class _Run:
    k0: int
    k1: int
    # "full": fully visible tiles, no mask; "partial": apply the elementwise mask;
    # "causal": the diagonal square [i0, i1) x [i0, i1) masked by the causal triangle alone
    kind: str
    # for "partial" runs: which of the two masked intervals can touch these rows
    lower: bool = True
    upper: bool = True

    @property
    def masked(self) -> bool:
        return self.kind != FULL_RUN


def _plan(
    bounds: torch.Tensor,
    sq: int,
    sk: int,
    block_q: int,
    block_k: int,
    max_width: int,
    causal: bool = False,
) -> list[list[_Run]]:
    """For each query block, its runs of key tiles (fully masked tiles left out)."""
    classes_t, low_t, up_t = shared_tile_classes(bounds, sq, block_q, block_k)
    classes, free, up_free = classes_t.tolist(), low_t.tolist(), up_t.tolist()
    plan: list[list[_Run]] = []
    for qi, row in enumerate(classes):
        i0, i1 = qi * block_q, min((qi + 1) * block_q, sq)
        stop = len(row)
        diagonal: _Run | None = None
        if causal and block_q % block_k == 0 and i1 <= sk:
            first, last = i0 // block_k, -(-i1 // block_k)
            if all(free[qi][first:last]):
                diagonal, stop = _Run(i0, i1, CAUSAL_RUN), first
        runs: list[_Run] = []
        start, kind = -1, SKIP
        for kb, cls in enumerate([*row[:stop], SKIP]):
            k0 = kb * block_k
            if start >= 0 and (cls != kind or k0 - start >= max_width):
                first_kb = start // block_k
                runs.append(
                    _Run(
                        start,
                        min(k0, sk),
                        FULL_RUN if kind == FULL else PARTIAL_RUN,
                        lower=not all(free[qi][first_kb:kb]),
                        upper=not all(up_free[qi][first_kb:kb]),
                    )
                )
                start = -1
            if cls != SKIP and start < 0:
                start, kind = k0, cls
        if diagonal is not None:
            runs.append(diagonal)
        plan.append(runs)
    return plan


def _run_mask(bounds: torch.Tensor, run: _Run, i0: int, i1: int) -> torch.Tensor | None:
    """Boolean ``[Bm, Hm, L, W]`` (True = masked) for a partial run, None for a visible one."""
    if not run.masked:
        return None
    return masked_tile(bounds[:, :, run.k0 : run.k1], i0, i1, lower=run.lower, upper=run.upper)


def _bshd(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed ``[B, H, S, D]`` view of ``[B, S, H, D]`` storage: what is written through it comes
    back to the caller contiguous in the public layout (no copy when autograd stores the grad)."""
    b, h, s, d = shape
    return torch.zeros(b, s, h, d, dtype=dtype, device=device).transpose(1, 2)


def _width(b: int, hq: int, block_q: int, block_k: int, budget: int) -> int:
    return max(block_k, (budget // max(1, b * hq * block_q)) // block_k * block_k)


# ---------------------------------------------------------------- engine: matmul (any device)


def _matmul_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    plan: list[list[_Run]],
    block_q: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, hq, sq, _ = q.shape
    hk = k.shape[1]
    g = hq // hk
    dv = v.shape[-1]
    out = _bshd((b, hq, sq, dv), q.dtype, q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    for qi, runs in enumerate(plan):
        i0, i1 = qi * block_q, min((qi + 1) * block_q, sq)
        n = i1 - i0
        # GQA without repeating K/V: the G query heads of a KV head are stacked along rows;
        # the scale is folded into q once per block instead of once per score tile.
        qb = (q[:, :, i0:i1].float() * scale).reshape(b, hk, g * n, -1)
        m = torch.full((b, hk, g * n), _NEG_INF, device=q.device)
        l_sum = torch.zeros(b, hk, g * n, device=q.device)
        acc = torch.zeros(b, hk, g * n, dv, device=q.device)
        for run in runs:
            kb = k[:, :, run.k0 : run.k1].float()
            vb = v[:, :, run.k0 : run.k1].float()
            s = torch.matmul(qb, kb.transpose(-1, -2))
            mask = _run_mask(bounds, run, i0, i1)
            if mask is not None:
                s.view(b, hq, n, -1).masked_fill_(mask, _NEG_INF)
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows with nothing visible yet
            p = s.sub_(m_safe.unsqueeze(-1)).exp_()
            alpha = torch.exp(m - m_safe)
            l_sum = l_sum * alpha + p.sum(dim=-1)
            acc = acc * alpha.unsqueeze(-1) + torch.matmul(p, vb)
            m = m_new
        seen = l_sum > 0
        l_safe = torch.where(seen, l_sum, 1.0)
        out[:, :, i0:i1] = (acc / l_safe.unsqueeze(-1)).view(b, hq, n, dv).to(q.dtype)
        lse[:, :, i0:i1] = torch.where(seen, m + torch.log(l_safe), float("inf")).view(b, hq, n)
    return out, lse


def _matmul_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    plan: list[list[_Run]],
    block_q: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, hq, sq, _ = q.shape
    hk = k.shape[1]
    g = hq // hk
    delta = (do.float() * out.float()).sum(dim=-1)  # rowsum(dO * O), [B, Hq, Sq]
    dq = _bshd(q.shape, q.dtype, q.device)
    dk = _bshd(k.shape, torch.float32, q.device)
    dv = _bshd(v.shape, torch.float32, q.device)
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
            mask = _run_mask(bounds, run, i0, i1)
            if mask is not None:
                s.view(b, hq, n, -1).masked_fill_(mask, _NEG_INF)
            p = s.sub_(lse_b).exp_()  # masked entries and empty rows (lse=+inf) give 0
            dv[:, :, run.k0 : run.k1] += torch.matmul(p.transpose(-1, -2), dob)
            ds = torch.matmul(dob, vb.transpose(-1, -2)).sub_(delta_b).mul_(p)
            dqb += torch.matmul(ds, kb)
            dk[:, :, run.k0 : run.k1] += torch.matmul(ds.transpose(-1, -2), qb)
        dq[:, :, i0:i1] = (dqb * scale).view(b, hq, n, -1).to(q.dtype)
    return dq, dk.mul_(scale).to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------- engine: sdpa_cpu (fused CPU op)


def _cpu_op() -> Any:
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _float_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.where(mask, _NEG_INF, 0.0)


def _expand_kv(t: torch.Tensor, g: int) -> torch.Tensor:
    return t if g == 1 else t.repeat_interleave(g, dim=1)


def _merge_lse(
    acc: torch.Tensor, acc_lse: torch.Tensor, o_r: torch.Tensor, lse_r: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint keys by their log-sum-exps (rows that saw
    no key in either stay -inf)."""
    new = torch.logaddexp(acc_lse, lse_r)
    safe = torch.where(torch.isinf(new), 0.0, new)
    acc = acc * torch.exp(acc_lse - safe).unsqueeze(-1) + o_r.float() * torch.exp(lse_r - safe).unsqueeze(-1)
    return acc, new


def _fused_run_backward(
    dob: torch.Tensor,
    qb: torch.Tensor,
    ob: torch.Tensor,
    lse_b: torch.Tensor,
    k_run: torch.Tensor,
    v_run: torch.Tensor,
    scale: float,
    causal: bool,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One run's (dq, dk, dv) from the fused CPU backward, dk/dv folded back to the KV heads.
    Given the global out and lse, the op's P and rowsum(dO * O) are the global ones, so the
    per-run gradients add up exactly."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    nb, hk, w, d = k_run.shape
    g = qb.shape[1] // hk
    kb = _expand_kv(k_run, g).contiguous()
    vb = _expand_kv(v_run, g).contiguous()
    dq_r, dk_r, dv_r = op(dob, qb, kb, vb, ob, lse_b, 0.0, causal, attn_mask=_float_mask(mask), scale=scale)
    if g > 1:  # fold the query heads of each KV head back
        dk_r, dv_r = dk_r.view(nb, hk, g, w, d).sum(2), dv_r.view(nb, hk, g, w, -1).sum(2)
    return dq_r, dk_r, dv_r


def _sdpa_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    plan: list[list[_Run]],
    block_q: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    b, hq, sq, _ = q.shape
    g = hq // k.shape[1]
    dv = v.shape[-1]
    out = _bshd((b, hq, sq, dv), q.dtype, q.device)
    lse = torch.full((b, hq, sq), float("inf"), dtype=torch.float32, device=q.device)
    for qi, runs in enumerate(plan):
        i0, i1 = qi * block_q, min((qi + 1) * block_q, sq)
        qb = q[:, :, i0:i1]
        acc: torch.Tensor | None = None
        acc_lse = torch.full((b, hq, i1 - i0), _NEG_INF, device=q.device)
        for run in runs:
            is_causal = run.kind == CAUSAL_RUN  # the fused op skips the upper triangle itself
            mask = None if is_causal else _run_mask(bounds, run, i0, i1)
            kb = _expand_kv(k[:, :, run.k0 : run.k1], g)
            vb = _expand_kv(v[:, :, run.k0 : run.k1], g)
            o_r, lse_r = op(qb, kb, vb, 0.0, is_causal, attn_mask=_float_mask(mask), scale=scale)
            if mask is not None:
                # the op reports lse = 0 (and output 0) for a row it sees no key of
                lse_r = lse_r.masked_fill(mask.all(dim=-1), _NEG_INF)
            if acc is None:
                acc, acc_lse = o_r.float(), lse_r
                continue
            acc, acc_lse = _merge_lse(acc, acc_lse, o_r, lse_r)
        if acc is None:
            continue  # every key masked for this block: zeros and lse=+inf
        seen = ~torch.isinf(acc_lse)
        out[:, :, i0:i1] = torch.where(seen.unsqueeze(-1), acc, 0.0).to(q.dtype)
        lse[:, :, i0:i1] = torch.where(seen, acc_lse, float("inf"))
    return out, lse


def _sdpa_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    plan: list[list[_Run]],
    block_q: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    sq = q.shape[2]
    dq = _bshd(q.shape, q.dtype, q.device)
    dk = _bshd(k.shape, torch.float32, q.device)
    dv = _bshd(v.shape, torch.float32, q.device)
    for qi, runs in enumerate(plan):
        i0, i1 = qi * block_q, min((qi + 1) * block_q, sq)
        qb = q[:, :, i0:i1].contiguous()
        dob = do[:, :, i0:i1].contiguous()
        ob = out[:, :, i0:i1].contiguous()
        lse_b = lse[:, :, i0:i1].contiguous()
        dqb = torch.zeros(qb.shape, dtype=torch.float32, device=q.device)
        for run in runs:
            dq_r, dk_r, dv_r = _fused_run_backward(
                dob,
                qb,
                ob,
                lse_b,
                k[:, :, run.k0 : run.k1],
                v[:, :, run.k0 : run.k1],
                scale,
                False,
                _run_mask(bounds, run, i0, i1),
            )
            dqb += dq_r
            dk[:, :, run.k0 : run.k1] += dk_r
            dv[:, :, run.k0 : run.k1] += dv_r
        dq[:, :, i0:i1] = dqb.to(q.dtype)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------- engine: segments (CPU, exact plans)


def _segment_batches(plans: list[list[RowSegment]], b: int) -> list[tuple[slice, list[RowSegment]]]:
    """(batch rows, plan) pairs: one plan for the whole batch, or one per row."""
    if len(plans) == 1:
        return [(slice(0, b), plans[0])]
    return [(slice(i, i + 1), plan) for i, plan in enumerate(plans)]


def _segments_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plans: list[list[RowSegment]],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    b, hq, sq, _ = q.shape
    g = hq // k.shape[1]
    out = _bshd((b, hq, sq, v.shape[-1]), q.dtype, q.device)
    lse = torch.full((b, hq, sq), float("inf"), dtype=torch.float32, device=q.device)
    for rows, plan in _segment_batches(plans, b):
        for seg in plan:
            if not seg.runs:
                continue  # no visible key: zeros and lse=+inf
            qb = q[rows, :, seg.r0 : seg.r1]
            acc: torch.Tensor | None = None
            acc_lse = torch.empty(0)
            for run in seg.runs:
                kb = _expand_kv(k[rows, :, run.k0 : run.k1], g)
                vb = _expand_kv(v[rows, :, run.k0 : run.k1], g)
                o_r, lse_r = op(qb, kb, vb, 0.0, run.causal, scale=scale)
                if acc is None:
                    acc, acc_lse = o_r.float() if len(seg.runs) > 1 else o_r, lse_r
                    continue
                acc, acc_lse = _merge_lse(acc, acc_lse, o_r, lse_r)
            assert acc is not None
            out[rows, :, seg.r0 : seg.r1] = acc.to(q.dtype)
            lse[rows, :, seg.r0 : seg.r1] = acc_lse
    return out, lse


def _segments_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plans: list[list[RowSegment]],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b = q.shape[0]
    dq = _bshd(q.shape, q.dtype, q.device)
    dk = _bshd(k.shape, torch.float32, q.device)
    dv = _bshd(v.shape, torch.float32, q.device)
    for rows, plan in _segment_batches(plans, b):
        for seg in plan:
            if not seg.runs:
                continue
            sl = (rows, slice(None), slice(seg.r0, seg.r1))
            qb, dob, ob, lse_b = (t[sl].contiguous() for t in (q, do, out, lse))
            dqb: torch.Tensor | None = None
            for run in seg.runs:
                dq_r, dk_r, dv_r = _fused_run_backward(
                    dob,
                    qb,
                    ob,
                    lse_b,
                    k[rows, :, run.k0 : run.k1],
                    v[rows, :, run.k0 : run.k1],
                    scale,
                    run.causal,
                )
                dqb = dq_r.float() if dqb is None else dqb.add_(dq_r)
                dk[rows, :, run.k0 : run.k1] += dk_r
                dv[rows, :, run.k0 : run.k1] += dv_r
            assert dqb is not None
            dq[sl] = dqb.to(q.dtype)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------- dispatch


def _segments(
    q: torch.Tensor, k: torch.Tensor, bounds: torch.Tensor, engine: str
) -> list[list[RowSegment]] | None:
    """The exact segment plan when the segments engine runs (``auto`` on the CPU picks it for
    segment-shaped masks: packed documents, DPO triples, prefix-LM), else None."""
    if engine not in ("auto", "segments"):
        return None
    usable = q.device.type == "cpu" and _cpu_op() is not None
    if engine == "segments" and not usable:
        raise ValueError(
            f"engine='segments' needs CPU tensors and torch's fused CPU attention, got {q.device}"
        )
    plan = segment_plan(bounds, q.shape[2], k.shape[2]) if usable else None
    if engine == "segments" and plan is None:
        raise ValueError(
            "engine='segments' needs a segment-shaped mask (documents, shared-question, prefix-LM) "
            f"with one head and as many queries as keys; got bounds {tuple(bounds.shape)}, "
            f"{q.shape[2]} queries, {k.shape[2]} keys"
        )
    return plan


def _engine(q: torch.Tensor, engine: str) -> str:
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} is not one of {', '.join(ENGINES)}")
    if engine == "auto":
        return "sdpa_cpu" if q.device.type == "cpu" and _cpu_op() is not None else "matmul"
    if engine == "sdpa_cpu" and q.device.type != "cpu":
        raise ValueError(f"engine='sdpa_cpu' needs CPU tensors, got {q.device}")
    return engine


_FORWARD: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "matmul": _matmul_forward,
    "sdpa_cpu": _sdpa_forward,
}
_BACKWARD: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {
    "matmul": _matmul_backward,
    "sdpa_cpu": _sdpa_backward,
}


# Tile sizes per engine. The fused CPU op tiles internally and never holds a run's scores, so
# bigger query blocks (fewer op calls) are fine; its budget only caps the per-run K/V copies
# and dK/dV results (B * Hq * block_q * width elements -> width 4096 for 4 heads).
_DEFAULTS = {
    "matmul": (DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K, DEFAULT_BUDGET),
    "sdpa_cpu": (1024, 128, 16 * 1024 * 1024),
}


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    bounds: torch.Tensor,
    causal: bool,
    block_q: int | None,
    block_k: int | None,
    budget: int | None,
    engine: str,
) -> tuple[str, list[list[_Run]], int]:
    name = _engine(q, engine)
    dq, dk, dbudget = _DEFAULTS[name]
    bq, bk, bud = block_q or dq, block_k or dk, budget or dbudget
    b, hq, sq, _ = q.shape
    plan = _plan(bounds, sq, k.shape[2], bq, bk, _width(b, hq, bq, bk, bud), causal)
    return name, plan, bq


def flashmask_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    causal: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    budget: int | None = None,
    engine: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, Hq, Sq, D]``, ``k``/``v`` ``[B, Hk, Sk, D]`` (any strides) -> (out ``[B, Hq, Sq, D]``
    in q's dtype, lse ``[B, Hq, Sq]`` fp32, +inf on rows that see no key). ``causal`` says the
    bounds hold the causal triangle (it lets diagonal blocks use the fused causal path)."""
    segments = _segments(q, k, bounds, engine)
    if segments is not None:
        return _segments_forward(q, k, v, segments, scale)
    name, plan, bq = _prepare(q, k, bounds, causal, block_q, block_k, budget, engine)
    return _FORWARD[name](q, k, v, bounds, scale, plan, bq)


def flashmask_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    causal: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    budget: int | None = None,
    engine: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` in the layouts and dtypes of ``q``, ``k``, ``v``."""
    segments = _segments(q, k, bounds, engine)
    if segments is not None:
        return _segments_backward(do, q, k, v, out, lse, segments, scale)
    name, plan, bq = _prepare(q, k, bounds, causal, block_q, block_k, budget, engine)
    return _BACKWARD[name](do, q, k, v, out, lse, bounds, scale, plan, bq)


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
        causal: bool,
        block_q: int | None,
        block_k: int | None,
        budget: int | None,
        engine: str,
    ) -> torch.Tensor:
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out, lse = flashmask_forward(qt, kt, vt, bounds, scale, causal, block_q, block_k, budget, engine)
        ctx.save_for_backward(q, k, v, out, lse, bounds)
        ctx.args = (scale, causal, block_q, block_k, budget, engine)
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, bounds = ctx.saved_tensors
        dq, dk, dv = flashmask_backward(
            grads[0].transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            out,
            lse,
            bounds,
            *ctx.args,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), *([None] * 7)


def torch_flashmask_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    *,
    causal: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    budget: int | None = None,
    engine: str = "auto",
) -> torch.Tensor:
    """``[B, S, H, D]`` in and out; ``bounds`` from :func:`tandem_kernels.flashmask.bounds.normalize_bounds`
    (``causal`` as given there). Tile sizes default per engine."""
    out: torch.Tensor = FlashMaskTorchFunction.apply(
        q, k, v, bounds, scale, causal, block_q, block_k, budget, engine
    )
    return out
