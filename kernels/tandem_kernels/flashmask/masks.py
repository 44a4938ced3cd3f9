"""Mask builders for packed sequences, in FlashMask's column-wise format.

A mask is an int32 tensor ``startend_row_indices`` of shape ``[B, Hm, S, C]``: for
every *key column* ``j`` it names the ranges of *query rows* that may not see ``j``.
With ``causal=True`` the causal triangle (rows ``i < j``) is masked on top of that:

* ``C=1`` causal, ``[LTS]``: rows ``i >= LTS[j]`` are masked.
* ``C=2`` causal, ``[LTS, LTE]``: rows ``LTS[j] <= i < LTE[j]`` are masked.
* ``C=2`` non-causal, ``[LTS, UTE]``: rows ``i >= LTS[j]`` and rows ``i < UTE[j]`` are masked.
* ``C=4`` non-causal, ``[LTS, LTE, UTS, UTE]``: rows in ``[LTS, LTE)`` and in ``[UTS, UTE)``.

Every builder returns ``[1, 1, S, C]`` (one mask shared by all heads and the batch)
and says in its docstring which ``causal`` flag it is meant for. In the drawings a row
is a query, a column is a key, ``x`` is "may attend" and ``.`` is masked.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Lengths = Sequence[int] | torch.Tensor


def _lengths(seq_lens: Lengths) -> list[int]:
    lens = [int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    bad = [n for n in lens if n < 0]
    if bad:
        raise ValueError(f"sample lengths must be >= 0, got {bad[0]}")
    return lens


def _with_padding(lens: list[int], total_len: int | None) -> list[int]:
    """Append the padding tail as one more segment, so pad tokens only see each other."""
    used = sum(lens)
    if total_len is None:
        return lens
    if total_len < used:
        raise ValueError(f"total_len={total_len} is shorter than the samples' total length {used}")
    return [*lens, total_len - used] if total_len > used else lens


def _as_mask(cols: list[torch.Tensor]) -> torch.Tensor:
    out = torch.stack(cols, dim=-1) if cols else torch.zeros(0, 1, dtype=torch.int32)
    return out.to(torch.int32).reshape(1, 1, out.shape[0], -1).contiguous()


def document_mask(seq_lens: Lengths, total_len: int | None = None) -> torch.Tensor:
    """Causal document mask for packed SFT (use with ``causal=True``), ``C=1``.

    A sample of length ``n`` at offset ``o`` gives ``LTS = o + n`` to its columns:
    later samples' rows may not see it. Lengths ``[3, 2]`` and ``total_len=6`` (one pad
    token, which becomes its own segment)::

        keys   0 1 2 3 4 5
        row 0  x . . . . .      LTS = [3, 3, 3, 5, 5, 6]
        row 1  x x . . . .
        row 2  x x x . . .
        row 3  . . . x . .
        row 4  . . . x x .
        row 5  . . . . . x
    """
    lens = _with_padding(_lengths(seq_lens), total_len)
    lts = torch.cat([torch.full((n,), off + n, dtype=torch.int32) for off, n in _offsets(lens)] or [_empty()])
    return _as_mask([lts])


def shared_question_mask(
    triples: Sequence[tuple[int, int, int]], total_len: int | None = None
) -> torch.Tensor:
    """Shared-question mask for DPO / reward models (use with ``causal=True``), ``C=1``.

    Each triple ``(P, C, R)`` packs a prompt once followed by its chosen and its rejected
    answer; with ``L`` the triple's end, its columns get ``[L]*P + [o+P+C]*C + [L]*R``, so
    rejected tokens see the prompt but not the chosen answer. Several triples per pack
    are isolated from each other like documents. Triple ``(2, 2, 2)``::

        keys   0 1 2 3 4 5     (P P C C R R)
        row 0  x . . . . .      LTS = [6, 6, 4, 4, 6, 6]
        row 1  x x . . . .
        row 2  x x x . . .
        row 3  x x x x . .
        row 4  x x . . x .
        row 5  x x . . x x

    Pair it with :func:`shared_question_position_ids` so the rejected answer's positions
    continue from the prompt, as if it followed the prompt alone.
    """
    cols: list[torch.Tensor] = []
    off = 0
    for p, c, r in triples:
        for n in (p, c, r):
            if int(n) < 0:
                raise ValueError(f"triple lengths must be >= 0, got {(p, c, r)}")
        end = off + p + c + r
        cols += [
            torch.full((p,), end, dtype=torch.int32),
            torch.full((c,), off + p + c, dtype=torch.int32),
            torch.full((r,), end, dtype=torch.int32),
        ]
        off = end
    if total_len is not None:
        if total_len < off:
            raise ValueError(f"total_len={total_len} is shorter than the triples' total length {off}")
        cols.append(torch.full((total_len - off,), total_len, dtype=torch.int32))
    return _as_mask([torch.cat(cols) if cols else _empty()])


def shared_question_position_ids(
    triples: Sequence[tuple[int, int, int]], total_len: int | None = None
) -> torch.Tensor:
    """Position ids ``[1, S]`` for :func:`shared_question_mask`: prompt ``0..P-1``, chosen
    ``P..P+C-1``, rejected ``P..P+R-1`` (it also follows the prompt directly)."""
    parts: list[torch.Tensor] = []
    used = 0
    for p, c, r in triples:
        parts += [torch.arange(p), torch.arange(p, p + c), torch.arange(p, p + r)]
        used += p + c + r
    if total_len is not None:
        if total_len < used:
            raise ValueError(f"total_len={total_len} is shorter than the triples' total length {used}")
        parts.append(torch.arange(total_len - used))
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)).long().unsqueeze(0)


def prefix_lm_document_mask(
    seq_lens: Lengths, prefix_lens: Lengths, total_len: int | None = None
) -> torch.Tensor:
    """Prefix-LM document mask (use with ``causal=False``), ``C=2`` as ``[LTS, UTE]``.

    Inside each sample the first ``prefix_len`` tokens see each other both ways, the rest
    is causal; samples are isolated. Column ``j`` of a sample ``[o, o+n)`` with prefix
    ``p`` is visible to rows ``[UTE, LTS)`` with ``LTS = o + n`` and ``UTE = o`` inside
    the prefix, ``UTE = j`` after it. Lengths ``[4, 2]``, prefixes ``[2, 1]``::

        keys   0 1 2 3 4 5
        row 0  x x . . . .      LTS = [4, 4, 4, 4, 6, 6]
        row 1  x x . . . .      UTE = [0, 0, 2, 3, 4, 5]
        row 2  x x x . . .
        row 3  x x x x . .
        row 4  . . . . x .
        row 5  . . . . x x
    """
    lens = _lengths(seq_lens)
    prefixes = _lengths(prefix_lens)
    if len(prefixes) != len(lens):
        raise ValueError(f"got {len(prefixes)} prefix lengths for {len(lens)} samples")
    for n, p in zip(lens, prefixes, strict=True):
        if p > n:
            raise ValueError(f"prefix length {p} is longer than its sample ({n})")
    if total_len is not None and total_len > sum(lens):
        # The padding tail: a causal segment of its own.
        prefixes = [*prefixes, 0]
    lens = _with_padding(lens, total_len)
    lts: list[torch.Tensor] = []
    ute: list[torch.Tensor] = []
    for (off, n), p in zip(_offsets(lens), prefixes, strict=True):
        lts.append(torch.full((n,), off + n, dtype=torch.int32))
        ute.append(torch.cat([torch.full((p,), off), torch.arange(off + p, off + n)]).to(torch.int32))
    return _as_mask([torch.cat(lts or [_empty()]), torch.cat(ute or [_empty()])])


def sliding_window_mask(seq_lens: Lengths | int, window: int, total_len: int | None = None) -> torch.Tensor:
    """Causal sliding window (use with ``causal=True``), ``C=1``, optionally per document.

    Row ``i`` sees keys ``i - window < j <= i`` of its own sample: ``LTS[j] = min(j + window,
    o + n)``. ``seq_lens`` may be one int (a single sequence). Length 5, ``window=2``::

        keys   0 1 2 3 4
        row 0  x . . . .        LTS = [2, 3, 4, 5, 5]
        row 1  x x . . .
        row 2  . x x . .
        row 3  . . x x .
        row 4  . . . x x
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    lens = _with_padding(_lengths([seq_lens] if isinstance(seq_lens, int) else seq_lens), total_len)
    cols = [
        torch.clamp(torch.arange(off, off + n) + window, max=off + n).to(torch.int32)
        for off, n in _offsets(lens)
    ]
    return _as_mask([torch.cat(cols or [_empty()])])


def lengths_to_position_ids(seq_lens: Lengths, total_len: int | None = None) -> torch.Tensor:
    """Position ids ``[1, S]`` (int64) that restart at 0 for every sample (and the padding tail)."""
    lens = _with_padding(_lengths(seq_lens), total_len)
    parts = [torch.arange(n) for n in lens]
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)).long().unsqueeze(0)


def lengths_to_cu_seqlens(seq_lens: Lengths) -> torch.Tensor:
    """Cumulative sample boundaries ``[0, n0, n0+n1, ...]`` (int32), as varlen kernels take them."""
    lens = torch.tensor(_lengths(seq_lens), dtype=torch.int32)
    return torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lens, 0).to(torch.int32)])


def _offsets(lens: list[int]) -> list[tuple[int, int]]:
    out, off = [], 0
    for n in lens:
        out.append((off, n))
        off += n
    return out


def _empty() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.int32)
