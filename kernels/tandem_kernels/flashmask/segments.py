"""Exact segment plans: a structured mask as a few dense attention calls, no elementwise mask.

Packing masks (documents, shared-question DPO triples, prefix-LM documents) change only at
a few positions. Cut rows and keys at the same *boundaries*: every column change of the
bounds and every interval end ``LTS/LTE/UTS/UTE``. Then each (row segment, key segment)
square is exactly one of

* skipped: an interval masks all its rows, or it lies above the causal diagonal;
* full: nothing masks it;
* diagonal: the same segment for rows and keys under a causal triangle (``is_causal``).

so the attention of a row segment is one dense call per visible run of keys: the cost
follows the mask's visible area and no ``rows x keys`` boolean ever exists. Row segments
that each see everything from one start ``s`` up to themselves (a document split by a
boundary, a DPO prompt followed by its chosen answer) are merged into one causal call.

A column masked above the diagonal exactly (``UTS = 0``, ``UTE = j``: the causal triangle
written as an interval, as non-causal prefix-LM masks do) counts as a causal column, so its
per-column ``UTE`` does not make every column a boundary. Masks without such structure
(random bounds, sliding windows) have too many boundaries; :func:`segment_plan` returns
None for them and the tiled path runs instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# More segments than keys / MIN_AVG_SEGMENT (and than MIN_SEGMENTS): the tiled path is cheaper.
MIN_AVG_SEGMENT = 16
MIN_SEGMENTS = 16
# Longer row segments are split into row chunks of this size (each chunk sees the keys before
# it in full and its own square causally), which bounds the fused backward's buffers: one
# 16K-row causal call peaked at twice the memory of 1K-row chunks.
MAX_SEGMENT_ROWS = 1024
# Full runs wider than this are split too: the backward copies a run's keys and returns its
# dK/dV, so this caps those buffers (the tiled path's budget gives the same 4096 for 4 heads).
MAX_RUN_KEYS = 4096


@dataclass(frozen=True)
class SegmentRun:
    k0: int
    k1: int
    causal: bool  # a diagonal square [k0, k1) x [k0, k1) under the causal triangle


@dataclass(frozen=True)
class RowSegment:
    r0: int
    r1: int
    runs: tuple[SegmentRun, ...]  # empty: these rows see no key


def _boundaries(b: torch.Tensor, sq: int, causal_col: torch.Tensor) -> torch.Tensor:
    sk = b.shape[0]
    key = b.clone()
    key[:, 2:] = torch.where(causal_col.unsqueeze(-1), -1, b[:, 2:])
    changes = (key[1:] != key[:-1]).any(dim=-1).nonzero().squeeze(-1) + 1
    ends = torch.cat([b[:, :2].reshape(-1), b[:, 2:][~causal_col].reshape(-1)])
    edge = torch.tensor([0, sk], dtype=changes.dtype)
    cuts = torch.cat([edge, changes, ends.to(changes.dtype).clamp(0, sq)])
    return torch.unique(cuts)


def _row_segments(b: torch.Tensor, cuts: list[int], causal_col: torch.Tensor) -> list[RowSegment]:
    n = len(cuts) - 1
    starts = torch.tensor(cuts[:-1])
    ends = torch.tensor(cuts[1:])
    col = b[starts].long()  # every column of a segment has the same bounds
    ccol = causal_col[starts]
    r0, r1 = starts.view(-1, 1), ends.view(-1, 1)
    lower = (r0 >= col[:, 0]) & (r1 <= col[:, 1])
    upper = ~ccol & (r0 >= col[:, 2]) & (r1 <= col[:, 3])
    idx = torch.arange(n)
    future = ccol & (idx.view(1, -1) > idx.view(-1, 1))
    diag = ccol & (idx.view(1, -1) == idx.view(-1, 1))
    # 0 skip, 1 full, 2 diagonal
    kind = torch.where(lower | upper | future, 0, torch.where(diag, 2, 1)).tolist()
    rows: list[RowSegment] = []
    for i in range(n):
        runs: list[SegmentRun] = []
        for j, k in enumerate(kind[i]):
            if k == 0:
                continue
            c0, c1 = cuts[j], cuts[j + 1]
            if k == 1 and runs and not runs[-1].causal and runs[-1].k1 == c0:
                runs[-1] = SegmentRun(runs[-1].k0, c1, False)
            else:
                runs.append(SegmentRun(c0, c1, k == 2))
        rows.append(RowSegment(cuts[i], cuts[i + 1], tuple(runs)))
    return _merge_causal(rows)


def _causal_start(seg: RowSegment) -> int | None:
    """``s`` when the rows see exactly keys ``[s, row]`` (a causal block that began at ``s``)."""
    runs = seg.runs
    if len(runs) == 1 and runs[0].causal and runs[0].k0 == seg.r0:
        return seg.r0
    if (
        len(runs) == 2
        and not runs[0].causal
        and runs[1].causal
        and runs[0].k1 == seg.r0
        and runs[1].k0 == seg.r0
    ):
        return runs[0].k0
    return None


def _split_long(seg: RowSegment, limit: int) -> list[RowSegment]:
    """Row chunks of at most ``limit`` rows; a diagonal run becomes the keys before each chunk
    (visible in full) plus the chunk's own causal square."""
    if seg.r1 - seg.r0 <= limit:
        return [seg]
    out = []
    for a in range(seg.r0, seg.r1, limit):
        b = min(a + limit, seg.r1)
        runs: list[SegmentRun] = []
        for run in seg.runs:
            if not run.causal:
                runs.append(run)
                continue
            if a > run.k0:  # the part of the diagonal block above this chunk
                if runs and not runs[-1].causal and runs[-1].k1 == run.k0:
                    runs[-1] = SegmentRun(runs[-1].k0, a, False)
                else:
                    runs.append(SegmentRun(run.k0, a, False))
            runs.append(SegmentRun(a, b, True))
        out.append(RowSegment(a, b, tuple(runs)))
    return out


def _narrow_runs(seg: RowSegment, limit: int) -> RowSegment:
    """Full runs of at most ``limit`` keys (merged again by log-sum-exp)."""
    runs: list[SegmentRun] = []
    for run in seg.runs:
        if run.causal or run.k1 - run.k0 <= limit:
            runs.append(run)
            continue
        runs += [SegmentRun(k, min(k + limit, run.k1), False) for k in range(run.k0, run.k1, limit)]
    return RowSegment(seg.r0, seg.r1, tuple(runs))


def _merge_causal(rows: list[RowSegment]) -> list[RowSegment]:
    out: list[RowSegment] = []
    for seg in rows:
        prev = out[-1] if out else None
        if prev is not None and prev.r1 == seg.r0:
            start, prev_start = _causal_start(seg), _causal_start(prev)
            if start is not None and start == prev_start == prev.r0:
                out[-1] = RowSegment(prev.r0, seg.r1, (SegmentRun(prev.r0, seg.r1, True),))
                continue
        out.append(seg)
    return out


def segment_plan(bounds: torch.Tensor, sq: int, sk: int) -> list[list[RowSegment]] | None:
    """Per batch row of ``bounds`` (``[Bm, Hm, Sk, 4]`` from ``normalize_bounds``), its row
    segments; None when the mask is not segment-shaped (then use the tiled path)."""
    if sq != sk or bounds.shape[1] != 1 or sk == 0:
        return None
    b_all = bounds[:, 0].cpu()
    cols = torch.arange(sk, dtype=b_all.dtype)
    plans = []
    for b in b_all:
        causal_col = (b[:, 2] == 0) & (b[:, 3] == cols)
        if sk > 1:
            # column 0's triangle masks no row: give it its neighbour's kind (one cut fewer)
            causal_col[0] = causal_col[1]
        cuts = _boundaries(b, sq, causal_col)
        if cuts.numel() - 1 > max(MIN_SEGMENTS, sk // MIN_AVG_SEGMENT):
            return None
        segments = _row_segments(b, cuts.tolist(), causal_col)
        parts = [part for seg in segments for part in _split_long(seg, MAX_SEGMENT_ROWS)]
        plans.append([_narrow_runs(part, MAX_RUN_KEYS) for part in parts])
    return plans
