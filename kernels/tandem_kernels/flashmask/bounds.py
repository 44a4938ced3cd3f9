"""One internal form for every mask variant, and the per-tile summaries that let kernels skip work.

All four public variants (``C`` = 1, 2 causal or not, 4) become two masked row
intervals per key column, ``[LTS, LTE)`` (the "lower" one) and ``[UTS, UTE)`` (the
"upper" one); the causal triangle is the upper interval ``[0, j)``. An empty interval
is stored as ``[Sq, Sq)`` (lower) or ``[0, 0)`` (upper) so that block minima and maxima
are not spoilt by it.

A tile (query rows ``[i0, i1)`` x key columns ``[j0, j1)``) is

* fully masked when every column masks all its rows through one interval:
  ``i0 >= max(LTS) and i1 <= min(LTE)`` or the same for ``UTS/UTE``;
* fully visible when no interval of any column touches its rows:
  ``(i1 <= min(LTS) or i0 >= max(LTE)) and (i1 <= min(UTS) or i0 >= max(UTE))``;
* partial otherwise (the elementwise mask is applied).

Both tests are conservative: a tile they call partial may still be all masked or all
visible (e.g. two intervals that together cover it), which costs time, never correctness.
"""

from __future__ import annotations

import torch

SKIP, PARTIAL, FULL = 0, 1, 2


def normalize_bounds(
    startend_row_indices: torch.Tensor | None,
    *,
    causal: bool,
    batch: int,
    sq: int,
    sk: int,
    device: torch.device,
) -> torch.Tensor:
    """Return int32 ``[Bm, Hm, Sk, 4]`` = ``(LTS, LTE, UTS, UTE)``; ``Bm`` is 1 or ``batch``."""
    cols = torch.arange(sk, device=device, dtype=torch.int32)
    if startend_row_indices is None:
        lts = torch.full((1, 1, sk), sq, device=device, dtype=torch.int32)
        lte = lts.clone()
        uts = torch.zeros_like(lts)
        ute = torch.clamp(cols, max=sq).view(1, 1, sk) if causal else torch.zeros_like(lts)
        return _finish(lts, lte, uts, ute, sq)

    m = startend_row_indices
    if m.dim() != 4:
        raise ValueError(f"startend_row_indices must be [B, Hm, Sk, C], got shape {tuple(m.shape)}")
    if m.dtype.is_floating_point or m.dtype == torch.bool:
        raise ValueError(f"startend_row_indices must be an integer tensor (int32), got {m.dtype}")
    bm, _, msk, c = m.shape
    if bm not in (1, batch):
        raise ValueError(f"startend_row_indices batch {bm} must be 1 or the batch size {batch}")
    if msk != sk:
        raise ValueError(f"startend_row_indices has {msk} key columns, but the keys have length {sk}")
    allowed = (1, 2) if causal else (2, 4)
    if c not in allowed:
        raise ValueError(
            f"startend_row_indices last dim C={c} is not valid with causal={causal}; use one of {allowed}"
        )
    m = m.to(device=device, dtype=torch.int32)
    full = torch.full_like(m[..., 0], sq)
    zero = torch.zeros_like(full)
    if causal:
        lts = m[..., 0]
        lte = m[..., 1] if c == 2 else full
        uts = zero
        ute = torch.clamp(cols, max=sq).expand_as(lts)
    elif c == 2:
        lts, lte, uts, ute = m[..., 0], full, zero, m[..., 1]
    else:
        lts, lte, uts, ute = m[..., 0], m[..., 1], m[..., 2], m[..., 3]
    return _finish(lts, lte, uts, ute, sq)


def _finish(
    lts: torch.Tensor, lte: torch.Tensor, uts: torch.Tensor, ute: torch.Tensor, sq: int
) -> torch.Tensor:
    lts, lte, uts, ute = (torch.clamp(t, 0, sq) for t in (lts, lte, uts, ute))
    low_empty = lts >= lte
    lts = torch.where(low_empty, sq, lts)
    lte = torch.where(low_empty, sq, lte)
    up_empty = uts >= ute
    uts = torch.where(up_empty, 0, uts)
    ute = torch.where(up_empty, 0, ute)
    return torch.stack([lts, lte, uts, ute], dim=-1).to(torch.int32).contiguous()


def masked_tile(
    bounds: torch.Tensor, row0: int, row1: int, *, lower: bool = True, upper: bool = True
) -> torch.Tensor:
    """Boolean ``[Bm, Hm, row1-row0, T]`` (True = masked) for the columns in ``bounds [Bm, Hm, T, 4]``.

    ``lower=False`` / ``upper=False`` leave out an interval the caller knows misses these rows
    (each one costs two full-size comparisons)."""
    rows = torch.arange(row0, row1, device=bounds.device, dtype=torch.int32).view(-1, 1)
    b = bounds.unsqueeze(-3)  # [Bm, Hm, 1, T, 4]
    out: torch.Tensor | None = None
    for wanted, lo, hi in ((lower, 0, 1), (upper, 2, 3)):
        if not wanted:
            continue
        part = rows >= b[..., lo]
        part &= rows < b[..., hi]
        out = part if out is None else out.logical_or_(part)
    if out is None:
        return torch.zeros(
            (*bounds.shape[:2], row1 - row0, bounds.shape[2]), dtype=torch.bool, device=bounds.device
        )
    return out


def block_stats(bounds: torch.Tensor, block_k: int) -> torch.Tensor:
    """Per key block min and max of each bound: int32 ``[Bm, Hm, nk, 8]`` =
    ``(minLTS, maxLTS, minLTE, maxLTE, minUTS, maxUTS, minUTE, maxUTE)``."""
    bm, hm, sk, _ = bounds.shape
    nk = -(-sk // block_k)
    pad = nk * block_k - sk
    if pad:
        # Repeating the last column leaves every block's min and max unchanged.
        bounds = torch.cat([bounds, bounds[:, :, -1:].expand(bm, hm, pad, 4)], dim=2)
    blocks = bounds.view(bm, hm, nk, block_k, 4)
    mins = blocks.amin(dim=3)
    maxs = blocks.amax(dim=3)
    return torch.stack([mins, maxs], dim=-1).reshape(bm, hm, nk, 8).contiguous()


def tile_classes(stats: torch.Tensor, sq: int, block_q: int) -> torch.Tensor:
    """``[Bm, Hm, nq, nk]`` int8 of SKIP / PARTIAL / FULL from :func:`block_stats`' output."""
    nq = -(-sq // block_q)
    i0 = (torch.arange(nq, device=stats.device) * block_q).view(1, 1, nq, 1)
    i1 = torch.clamp(i0 + block_q, max=sq)
    s = stats.unsqueeze(2)  # [Bm, Hm, 1, nk, 8]
    min_lts, max_lts, min_lte, max_lte = s[..., 0], s[..., 1], s[..., 2], s[..., 3]
    min_uts, max_uts, min_ute, max_ute = s[..., 4], s[..., 5], s[..., 6], s[..., 7]
    skip = ((i0 >= max_lts) & (i1 <= min_lte)) | ((i0 >= max_uts) & (i1 <= min_ute))
    full = ((i1 <= min_lts) | (i0 >= max_lte)) & ((i1 <= min_uts) | (i0 >= max_ute))
    out = torch.full(skip.shape, PARTIAL, dtype=torch.int8, device=stats.device)
    out[full] = FULL
    out[skip] = SKIP
    return out


def interval_free(stats: torch.Tensor, sq: int, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[Bm, Hm, nq, nk]`` bools: the lower interval ``[LTS, LTE)`` (resp. the upper one) touches
    no row of the tile. Under ``causal=True`` a lower-free tile is masked by the triangle alone."""
    nq = -(-sq // block_q)
    i0 = (torch.arange(nq, device=stats.device) * block_q).view(1, 1, nq, 1)
    i1 = torch.clamp(i0 + block_q, max=sq)
    s = stats.unsqueeze(2)
    return (i1 <= s[..., 0]) | (i0 >= s[..., 3]), (i1 <= s[..., 4]) | (i0 >= s[..., 7])


def shared_tile_classes(
    bounds: torch.Tensor, sq: int, block_q: int, block_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[nq, nk]`` classes valid for every batch row and head (a tile is skipped only if all
    skip), and the matching :func:`interval_free` flags (lower, upper)."""
    stats = block_stats(bounds, block_k)
    bm, hm, nk, _ = stats.shape
    flat = stats.view(bm * hm, nk, 4, 2)
    merged = torch.stack([flat[..., 0].amin(0), flat[..., 1].amax(0)], dim=-1).reshape(1, 1, nk, 8)
    low, up = interval_free(merged, sq, block_q)
    return tile_classes(merged, sq, block_q)[0, 0], low[0, 0], up[0, 0]
