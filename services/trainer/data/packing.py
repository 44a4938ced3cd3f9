"""Zero-padding packing: many samples per sequence, isolated by the attention mask.

Samples are grouped into packs of at most ``max_tokens_per_pack`` tokens with
best-fit-decreasing (BFD) over *shuffled buffers*: the data is shuffled, cut into
buffers of ``buffer_size`` samples, and each buffer is packed on its own (longest
sample first, each into the fullest pack it still fits). Packing whole datasets at
once would put every long sample in the first packs; buffers keep the order mixed
across training while still filling packs to ~99%.

A pack of three SFT samples A (3 tokens), B (2), C (2) and one pad token ``_``::

    tokens        a0 a1 a2 b0 b1 c0 c1 _
    position_ids   0  1  2  0  1  0  1  0      restart per sample
    labels        a1 a2  X b1  X c1  X  X      X = -100: no label across a boundary

    attention (row = query, column = key, x = may attend; document mask, causal):

              a0 a1 a2 b0 b1 c0 c1 _
        a0     x  .  .  .  .  .  .  .
        a1     x  x  .  .  .  .  .  .
        a2     x  x  x  .  .  .  .  .
        b0     .  .  .  x  .  .  .  .
        b1     .  .  .  x  x  .  .  .
        c0     .  .  .  .  .  x  .  .
        c1     .  .  .  .  .  x  x  .
        _      .  .  .  .  .  .  .  x

(labels are shown already shifted: the label at a position is the next token, and
the last token of each sample predicts nothing.) The mask is passed as FlashMask's
column-wise ``startend_row_indices`` (``tandem_kernels.document_mask``), so the attention
kernel skips the masked blocks instead of materialising an ``S x S`` mask.

A DPO pack holds each pair's prompt P once, then its chosen C and rejected R
answers, with the shared-question mask (``tandem_kernels.shared_question_mask``)::

    tokens        p0 p1 c0 c1 r0 r1
    position_ids   0  1  2  3  2  3        rejected continues from the prompt

              p0 p1 c0 c1 r0 r1
        p0     x  .  .  .  .  .
        p1     x  x  .  .  .  .
        c0     x  x  x  .  .  .
        c1     x  x  x  x  .  .
        r0     x  x  .  .  x  .        rejected sees the prompt, never the chosen answer
        r1     x  x  .  .  x  x

Several pairs share a pack, each isolated from the others like SFT documents.

A KTO pack generalises this to a *prompt group*: rows that share a prompt keep it once,
followed by every row's completion and its mismatched KL completion (another row's
completion, see ``recipes/kto.py``); each continuation sees the prompt and itself only.
Prompt P with answers A, B, C (column-wise ``LTS``: the prompt's columns are seen up to
the group's end, each answer's only up to its own end)::

    tokens        p0 p1 a0 a1 b0 c0 c1
    position_ids   0  1  2  3  2  2  3

              p0 p1 a0 a1 b0 c0 c1
        a0     x  x  x  .  .  .  .
        a1     x  x  x  x  .  .  .
        b0     x  x  .  .  x  .  .
        c0     x  x  .  .  .  x  .
        c1     x  x  .  .  .  x  x
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.trainer.data.tokenize import IGNORE, PairSample, SFTSample


@dataclass
class PromptGroup:
    """A prompt once and the continuations that each follow it alone."""

    prompt: list[int]
    answers: list[list[int]]

    def __len__(self) -> int:
        return len(self.prompt) + sum(len(a) for a in self.answers)


class PackingError(ValueError):
    pass


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices into ``lengths``, each summing to at most ``capacity``.

    Longest first; each item goes to the bin with the least room that still fits it
    (kept in a sorted list of (room, bin) so each placement is O(log n) to find).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rooms: list[tuple[int, int]] = []  # (remaining room, bin index), sorted
    bins: list[list[int]] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise PackingError(f"sample {i} has {n} tokens, more than max_tokens_per_pack={capacity}")
        pos = bisect.bisect_left(rooms, (n, -1))
        if pos < len(rooms):
            room, b = rooms.pop(pos)
            bins[b].append(i)
            bisect.insort(rooms, (room - n, b))
        else:
            bins.append([i])
            bisect.insort(rooms, (capacity - n, len(bins) - 1))
    return bins


def shuffled_bfd(
    lengths: Sequence[int], capacity: int, *, seed: int, buffer_size: int = 1024
) -> list[list[int]]:
    """BFD within shuffled buffers; the packs themselves are shuffled too."""
    rng = random.Random(seed)
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    packs: list[list[int]] = []
    for start in range(0, len(idx), buffer_size):
        chunk = idx[start : start + buffer_size]
        for b in best_fit_decreasing([lengths[i] for i in chunk], capacity):
            packs.append([chunk[j] for j in b])
    rng.shuffle(packs)
    return packs


def _round_up(n: int, multiple: int) -> int:
    return n if multiple <= 1 else -(-n // multiple) * multiple


def _padded(
    ids: list[int], labels: list[int], pos: list[int], pad_id: int, multiple: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pack's ``[1, S]`` input ids, labels and positions, padded up to a multiple of ``multiple``
    (pad tokens are ``pad_id``, have no label, and count positions from 0)."""
    pad = _round_up(len(ids), multiple) - len(ids)
    t = torch.tensor
    return t([ids + [pad_id] * pad]), t([labels + [IGNORE] * pad]), t([pos + list(range(pad))])


@dataclass
class Pack:
    """One packed sequence (``[1, S]`` tensors) and the lengths that define its mask."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    seq_lens: list[int]
    # DPO only: (prompt, chosen, rejected) lengths per pair, in pack order
    triples: list[tuple[int, int, int]] = field(default_factory=list)
    sample_ids: list[int] = field(default_factory=list)
    # KTO only: (prompt length, answer lengths) per prompt group, in pack order
    groups: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)

    @property
    def real_tokens(self) -> int:
        return sum(self.seq_lens) if not self.triples else sum(sum(t) for t in self.triples)

    @property
    def total_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def mask(self) -> torch.Tensor:
        """FlashMask ``startend_row_indices`` for this pack ([1, 1, S, 1], int32)."""
        import tandem_kernels

        if self.groups:
            return group_mask(self.groups, self.total_tokens)
        if self.triples:
            return tandem_kernels.shared_question_mask(self.triples, total_len=self.total_tokens)
        return tandem_kernels.document_mask(self.seq_lens, total_len=self.total_tokens)


def pack_sft(
    samples: Sequence[SFTSample],
    indices: Sequence[int],
    *,
    pad_id: int,
    pad_to_multiple_of: int = 1,
) -> Pack:
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    lens: list[int] = []
    for i in indices:
        s = samples[i]
        n = len(s)
        ids += s.input_ids
        # shift: the label at t is the token at t+1 of the same sample; the last predicts nothing
        labels += [*s.labels[1:], IGNORE]
        pos += list(range(n))
        lens.append(n)
    return Pack(*_padded(ids, labels, pos, pad_id, pad_to_multiple_of), lens, sample_ids=list(indices))


def pack_pairs(
    pairs: Sequence[PairSample],
    indices: Sequence[int],
    *,
    pad_id: int,
    pad_to_multiple_of: int = 1,
) -> Pack:
    """DPO pairs, prompt once: labels mark each answer's tokens (shifted onto the previous
    position, which for an answer's first token is the prompt's last token, or the
    rejected answer's own start position seeing the prompt through the mask)."""
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    triples: list[tuple[int, int, int]] = []
    for i in indices:
        s = pairs[i]
        p, c, r = len(s.prompt), len(s.chosen), len(s.rejected)
        ids += s.prompt + s.chosen + s.rejected
        pos += list(range(p)) + list(range(p, p + c)) + list(range(p, p + r))
        triples.append((p, c, r))
        labels += [IGNORE] * len(s.prompt) + [IGNORE] * (c + r)
    # Labels are placed by `pair_label_positions`; DPO sums log-probs per answer.
    return Pack(
        *_padded(ids, labels, pos, pad_id, pad_to_multiple_of),
        [sum(x) for x in triples],
        triples=triples,
        sample_ids=list(indices),
    )


def pair_logit_index(
    triples: Sequence[tuple[int, int, int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a DPO pack: (logit positions, target positions, segment ids) of every answer token.

    Answer token at position ``t`` is predicted by the logits of the token before it *in
    its own sequence*: for the first chosen token that is the prompt's last token; for
    the first rejected token too (the rejected answer follows the prompt, not the chosen
    answer). Segment ``2k`` is pair k's chosen answer, ``2k+1`` its rejected one.
    """
    src: list[int] = []
    tgt: list[int] = []
    seg: list[int] = []
    off = 0
    for k, (p, c, r) in enumerate(triples):
        last_prompt = off + p - 1
        for j in range(c):
            tgt.append(off + p + j)
            src.append(last_prompt if j == 0 else off + p + j - 1)
            seg.append(2 * k)
        for j in range(r):
            tgt.append(off + p + c + j)
            src.append(last_prompt if j == 0 else off + p + c + j - 1)
            seg.append(2 * k + 1)
        off += p + c + r
    return torch.tensor(src), torch.tensor(tgt), torch.tensor(seg)


def pack_groups(
    groups: Sequence[PromptGroup],
    indices: Sequence[int],
    *,
    pad_id: int,
    pad_to_multiple_of: int = 1,
) -> Pack:
    """Prompt groups (KTO), each prompt once; log-probs are read with :func:`group_logit_index`."""
    ids: list[int] = []
    pos: list[int] = []
    shapes: list[tuple[int, tuple[int, ...]]] = []
    for i in indices:
        g = groups[i]
        p = len(g.prompt)
        ids += g.prompt
        pos += list(range(p))
        for a in g.answers:
            ids += a
            pos += list(range(p, p + len(a)))
        shapes.append((p, tuple(len(a) for a in g.answers)))
    # no labels: log-probs are read at the answers' positions (group_logit_index)
    return Pack(
        *_padded(ids, [IGNORE] * len(ids), pos, pad_id, pad_to_multiple_of),
        [p + sum(a) for p, a in shapes],
        sample_ids=list(indices),
        groups=shapes,
    )


def group_mask(shapes: Sequence[tuple[int, tuple[int, ...]]], total_len: int) -> torch.Tensor:
    """FlashMask column-wise ``LTS`` (``C=1``, causal) of prompt groups; the generalisation
    of ``tandem_kernels.shared_question_mask`` to any number of answers per prompt."""
    lts: list[int] = []
    off = 0
    for p, answers in shapes:
        end = off + p + sum(answers)
        lts += [end] * p
        a_off = off + p
        for n in answers:
            lts += [a_off + n] * n
            a_off += n
        off = end
    lts += [total_len] * (total_len - off)  # padding sees only padding
    return torch.tensor(lts, dtype=torch.int32).reshape(1, 1, total_len, 1)


def group_logit_index(
    shapes: Sequence[tuple[int, tuple[int, ...]]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logit positions, target positions, segment ids) of every answer token of a group pack;
    an answer's first token is predicted from the prompt's last token. Segments number the
    answers in pack order."""
    src: list[int] = []
    tgt: list[int] = []
    seg: list[int] = []
    off = 0
    k = 0
    for p, answers in shapes:
        last_prompt = off + p - 1
        a_off = off + p
        for n in answers:
            for j in range(n):
                tgt.append(a_off + j)
                src.append(last_prompt if j == 0 else a_off + j - 1)
                seg.append(k)
            a_off += n
            k += 1
        off = a_off
    return (
        torch.tensor(src, dtype=torch.long),
        torch.tensor(tgt, dtype=torch.long),
        torch.tensor(seg, dtype=torch.long),
    )


def plan_packs(
    lengths: Sequence[int], capacity: int, *, seed: int, buffer_size: int = 1024
) -> list[list[int]]:
    return shuffled_bfd(lengths, capacity, seed=seed, buffer_size=buffer_size)
