"""Dense reference: materialise the boolean ``[B, H, Sq, Sk]`` mask and call SDPA. Tests only."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem_kernels.flashmask.bounds import masked_tile, normalize_bounds


def dense_mask(
    startend_row_indices: torch.Tensor | None,
    *,
    causal: bool,
    batch: int,
    sq: int,
    sk: int,
    device: torch.device,
) -> torch.Tensor:
    """Boolean ``[Bm, Hm, Sq, Sk]``, True where the query row may attend the key column."""
    bounds = normalize_bounds(startend_row_indices, causal=causal, batch=batch, sq=sq, sk=sk, device=device)
    return ~masked_tile(bounds, 0, sq)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor | None = None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """``q [B, Sq, Hq, D]``, ``k``/``v`` ``[B, Sk, Hk, D]`` -> ``[B, Sq, Hq, D]``."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    allowed = dense_mask(startend_row_indices, causal=causal, batch=b, sq=sq, sk=sk, device=q.device)
    empty = ~allowed.any(dim=-1, keepdim=True)  # rows with no visible key
    # SDPA gives NaN for such rows (and NaN gradients); let them see everything and zero them after,
    # so their output is 0 and no gradient flows through them.
    allowed = allowed | empty
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=allowed,
        scale=softmax_scale if softmax_scale is not None else d**-0.5,
        enable_gqa=hq != hk,
    )
    out = torch.where(empty, torch.zeros((), dtype=out.dtype, device=out.device), out)
    return out.transpose(1, 2)
