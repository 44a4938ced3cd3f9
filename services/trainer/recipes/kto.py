"""KTO (Ethayarajh et al. 2024, TRL's semantics): unpaired rows ``(prompt, completion, label)``.

Each row's reward is ``beta * (log pi(y|x) - log ref(y|x))`` on its summed completion
log-probs; desirable rows are pushed above the reference point ``z0`` and undesirable ones
below it (``losses.kto_loss``). ``z0`` is KTO's KL estimate: the micro-batch's mean
policy/reference log-ratio on *mismatched* completions (row i's prompt with another row's
completion), clamped at 0 and detached. The mismatch is fixed once per dataset (a seeded
rotation, as TRL's KL dataset shifts completions by one), so the reference side of it is
computed once, before the first update, and cached with the rest, like DPO's.

Rows that share a prompt form one *prompt group*: the prompt once, then every row's
completion and its KL completion, each seeing only the prompt and itself
(``packing.group_mask``). Groups are packed like DPO pairs, several per pack.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from services.trainer.data.formats import KTORecord
from services.trainer.data.packing import PromptGroup, group_logit_index, pack_groups
from services.trainer.data.tokenize import KTOSample, tokenize_kto
from services.trainer.losses import kto_kl, kto_loss, kto_stats, kto_weights, segment_sums
from services.trainer.modeling import label_logps
from services.trainer.recipes.dpo import PreferenceRecipe, dpo_schedule


def kl_partners(n: int, seed: int) -> list[int]:
    """Row i's KL completion comes from row ``partner[i]``: a seeded rotation by one, so
    every completion is used once as a mismatch (a single row is its own partner)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    partner = [0] * n
    for k, i in enumerate(order):
        partner[i] = order[(k + 1) % n]
    return partner


def prompt_groups(
    samples: Sequence[KTOSample], partner: Sequence[int], capacity: int | None = None
) -> tuple[list[PromptGroup], list[list[int]]]:
    """Rows sharing a prompt (same token ids) become one group; answers are laid out as
    ``[completion_i, kl_completion_i]`` per row. A group that would outgrow ``capacity``
    (one pack) starts another one for the same prompt. Returns the groups and their rows."""
    by_prompt: dict[tuple[int, ...], int] = {}
    groups: list[PromptGroup] = []
    rows: list[list[int]] = []
    for i, s in enumerate(samples):
        key = tuple(s.prompt)
        extra = len(s.completion) + len(samples[partner[i]].completion)
        if key in by_prompt and capacity is not None and len(groups[by_prompt[key]]) + extra > capacity:
            del by_prompt[key]
        if key not in by_prompt:
            by_prompt[key] = len(groups)
            groups.append(PromptGroup(s.prompt, []))
            rows.append([])
        g = by_prompt[key]
        groups[g].answers += [s.completion, samples[partner[i]].completion]
        rows[g].append(i)
    return groups, rows


def pack_answer_logps(model: Any, pack: Any) -> torch.Tensor:
    """Summed log-probs of every answer of a group pack, pack order (``model``: the LM or the
    data-parallel wrapper, see ``modeling.label_logps``)."""
    src, tgt_pos, seg = group_logit_index(pack.groups)
    targets = pack.input_ids.reshape(-1)[tgt_pos]
    n = sum(len(a) for _, a in pack.groups)
    logps = label_logps(
        model, pack.input_ids, src, targets, position_ids=pack.position_ids, startend_row_indices=pack.mask()
    )
    return segment_sums(logps, seg, n)


def padded_answer_logps(model: Any, seqs: Sequence[tuple[list[int], list[int]]], pad_id: int) -> torch.Tensor:
    """The unpacked baseline: one right-padded row per (prompt, answer); summed answer log-probs."""
    longest = max(len(p) + len(a) for p, a in seqs)
    ids = torch.full((len(seqs), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), longest), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), longest), dtype=torch.long)
    for k, (p, a) in enumerate(seqs):
        row = p + a
        ids[k, : len(row)] = torch.tensor(row)
        mask[k, : len(row)] = 1
        labels[k, len(p) - 1 : len(row) - 1] = torch.tensor(a)
    flat = labels.reshape(-1)
    pos = (flat != -100).nonzero().squeeze(-1)
    return segment_sums(
        label_logps(model, ids, pos, flat[pos], attention_mask=mask), pos // longest, len(seqs)
    )


class KTOData:
    """A KTO dataset tokenised and grouped: rows, their KL partners, prompt groups."""

    def __init__(self, tokenizer: Any, records: Sequence[KTORecord], seed: int, capacity: int) -> None:
        self.samples = [tokenize_kto(tokenizer, r.prompt, r.completion, r.label) for r in records]
        self.partner = kl_partners(len(self.samples), seed)
        self.groups, self.rows = prompt_groups(self.samples, self.partner, capacity)
        self.labels = torch.tensor([s.label for s in self.samples], dtype=torch.bool)

    def rows_of(self, group_idx: Sequence[int]) -> list[int]:
        return [r for g in group_idx for r in self.rows[g]]


class KTORecipe(PreferenceRecipe):
    def setup(self) -> None:
        self.load_model(attn="flashmask" if self.cfg.packing else "sdpa")
        self.pad_id = int(self.tokenizer.pad_token_id)
        cap = self.cfg.max_tokens_per_pack
        self.data = KTOData(self.tokenizer, self.cfg.records, self.hp.seed, cap)
        self.eval_data = KTOData(self.tokenizer, self.cfg.eval_records or [], self.hp.seed, cap)
        self.schedule = self.step_schedule(dpo_schedule, [len(g) for g in self.data.groups])
        self.ref = self.reference("reference_logps", lambda: self.all_logps(self.data))
        self.make_optimizer()
        n_good = int(self.data.labels.sum())
        n_bad = len(self.data.samples) - n_good
        self.hooks.log(
            f"kto: {len(self.data.samples)} rows ({n_good} desirable) in {len(self.data.groups)} prompt groups, "
            f"{self.total_steps} steps, packing={self.cfg.packing}"
        )
        self.label_weights: tuple[float, float] = kto_weights(
            n_good, n_bad, self.hp.desirable_weight, self.hp.undesirable_weight
        )
        w_d, w_u = self.label_weights
        self.hooks.log(
            f"kto: weights desirable {w_d:.3g}, undesirable {w_u:.3g}: w_d*{n_good} / (w_u*{n_bad}) = "
            f"{w_d * n_good / max(w_u * n_bad, 1e-9):.2f} (the KTO paper advises [1, 4/3]; a weight not "
            "given is balanced to the counts)"
        )

    def logps(self, data: KTOData, group_idx: Sequence[int]) -> tuple[torch.Tensor, int, int]:
        """``[n_rows, 2]`` summed (completion, KL completion) log-probs of the groups' rows
        (in ``data.rows_of`` order), and the real and processed token counts."""
        with self.autocast():
            if self.cfg.packing:
                pack = pack_groups(
                    data.groups, group_idx, pad_id=self.pad_id, pad_to_multiple_of=self.cfg.pad_to_multiple_of
                )
                sums = pack_answer_logps(self.lm, pack)
                return sums.view(-1, 2), pack.real_tokens, pack.total_tokens
            seqs = [(data.groups[g].prompt, a) for g in group_idx for a in data.groups[g].answers]
            sums = padded_answer_logps(self.lm, seqs, self.pad_id)
            real = sum(len(p) + len(a) for p, a in seqs)
            return sums.view(-1, 2), real, len(seqs) * max(len(p) + len(a) for p, a in seqs)

    def all_logps(self, data: KTOData) -> torch.Tensor:
        return self.no_grad_pass(
            len(data.samples),
            [len(g) for g in data.groups],
            data.rows_of,
            lambda idx: self.logps(data, idx)[0],
        )

    def step_kl(self, pol_kl: torch.Tensor, ref_kl: torch.Tensor) -> torch.Tensor:
        """KTO's reference point over the whole micro-batch. Under torchrun an unpacked batch's
        rows are split over the ranks, so the mean log-ratio is all-reduced (its sum and its
        count; it is detached, so nothing else changes); packed, a micro-batch lies whole on
        one rank and its own rows give the single-process value."""
        if self.dist is None or self.cfg.packing:
            return kto_kl(pol_kl, ref_kl)
        total, count = self.dist.sum(
            float((pol_kl.detach().double() - ref_kl.double()).sum()), pol_kl.numel()
        )
        return pol_kl.new_tensor(max(total / count, 0.0) if count else 0.0)

    def losses(
        self,
        data: KTOData,
        rows: list[int],
        pol: torch.Tensor,
        ref: torch.Tensor,
        kl: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        kl = kto_kl(pol[:, 1].detach(), ref[:, 1]) if kl is None else kl
        hp = self.hp
        labels = data.labels[rows].to(pol.device)
        return kto_loss(pol[:, 0], ref[:, 0], labels, kl, hp.beta, *self.label_weights)

    def evaluate(self) -> dict[str, float]:
        ref = self.reference("reference_logps_eval", lambda: self.all_logps(self.eval_data))
        pol = self.all_logps(self.eval_data)
        rows = list(range(len(self.eval_data.samples)))
        losses, _ = self.losses(self.eval_data, rows, pol, ref)
        stats = kto_stats(self.hp.beta * (pol[:, 0] - ref[:, 0]), self.eval_data.labels, torch.zeros(()))
        return self.eval_metrics(losses, stats)

    def train_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        micro = self.schedule[step - 1]
        n_rows = sum(len(self.data.rows_of(m)) for m in micro)
        real = processed = 0
        loss_total = 0.0
        stats_acc: dict[str, float] = {}
        mine = self.my_micro(micro)
        for k, idx in enumerate(mine):
            with self.sync_grads(k, len(mine)):
                if idx is None:
                    self.step_kl(torch.zeros(0), torch.zeros(0))  # the KL all-reduce needs every rank
                    self.backward_filler()
                    continue
                rows = self.data.rows_of(idx)
                pol, r, p = self.logps(self.data, idx)
                real, processed = real + r, processed + p
                pol = pol.float()
                ref = self.ref[rows].to(pol.device)
                kl = self.step_kl(pol[:, 1], ref[:, 1])
                losses, stats = self.losses(self.data, rows, pol, ref, kl)
                loss_total += self.backward_part(losses, stats, len(rows), n_rows, stats_acc)
        return self.finish_pref_step(t0, loss_total, real, processed, stats_acc)
