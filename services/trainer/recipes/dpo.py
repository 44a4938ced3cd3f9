"""The preference-pair recipes: DPO (``loss_type`` sigmoid, ipo or hinge) and the
reference-free SimPO and ORPO. Pairs are packed with the prompt once per pair.

DPO's reference log-probs do not change during training, so they are computed once,
before the first update, for every pair (with the adapter switched off for LoRA; for a
full fine-tune the untouched model is the reference at that moment) and kept in a cache
file next to the checkpoints, which a resumed job reuses. SimPO and ORPO need none:
they compare per-token mean log-probs of the policy alone.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from services.trainer.data.packing import Pack, pack_pairs, pair_logit_index, plan_packs
from services.trainer.data.tokenize import PairSample, tokenize_pair
from services.trainer.losses import dpo_loss, orpo_loss, segment_sums, simpo_loss
from services.trainer.modeling import gather_logps, hidden_states, pack_hidden_states
from services.trainer.recipes.base import Recipe


def pack_pair_logps(model: Any, pack: Pack) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed answer log-probs (chosen, rejected), one per pair of the pack, pack order."""
    h = pack_hidden_states(model, pack)
    src, tgt_pos, seg = pair_logit_index(pack.triples)
    targets = pack.input_ids.reshape(-1)[tgt_pos]
    sums = segment_sums(gather_logps(model, h, src, targets), seg, 2 * len(pack.triples))
    return sums[0::2], sums[1::2]


def padded_pair_batch(
    pairs: Sequence[PairSample], indices: Sequence[int], pad_id: int
) -> dict[str, torch.Tensor]:
    """The unpacked baseline: 2B rows (prompt+chosen, then prompt+rejected) padded to the longest."""
    rows = [pairs[i].prompt + pairs[i].chosen for i in indices] + [
        pairs[i].prompt + pairs[i].rejected for i in indices
    ]
    answer_start = [len(pairs[i].prompt) for i in indices] * 2
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), longest), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for k, (row, start) in enumerate(zip(rows, answer_start, strict=True)):
        ids[k, : len(row)] = torch.tensor(row)
        mask[k, : len(row)] = 1
        labels[k, start - 1 : len(row) - 1] = torch.tensor(row[start:])
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def padded_pair_logps(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    device = next(model.parameters()).device
    h = hidden_states(model, batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
    flat = batch["labels"].reshape(-1)
    pos = (flat != -100).nonzero().squeeze(-1)
    rows = pos // batch["labels"].shape[1]
    sums = segment_sums(gather_logps(model, h, pos, flat[pos]), rows, batch["labels"].shape[0])
    half = sums.shape[0] // 2
    return sums[:half], sums[half:]


def dpo_schedule(
    lengths: Sequence[int], *, packing: bool, capacity: int, seed: int, epochs: int, per_step: int
) -> list[list[list[int]]]:
    steps: list[list[list[int]]] = []
    for epoch in range(epochs):
        if packing:
            micro = plan_packs(lengths, capacity, seed=seed + epoch)
            steps += [micro[i : i + per_step] for i in range(0, len(micro), per_step)]
        else:
            order = list(range(len(lengths)))
            random.Random(seed + epoch).shuffle(order)
            steps += [[order[i : i + per_step]] for i in range(0, len(order), per_step)]
    return steps


def pair_losses(
    kind: str,
    hp: Any,
    pc: torch.Tensor,
    pr: torch.Tensor,
    lengths: torch.Tensor,
    ref: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-pair losses of job type ``kind`` from summed answer log-probs ``pc``/``pr``;
    ``lengths`` is ``[n, 2]`` answer token counts, ``ref`` ``[n, 2]`` reference sums (dpo)."""
    if kind == "dpo":
        assert ref is not None
        rc, rr = ref[:, 0], ref[:, 1]
        if hp.loss_type == "ipo":  # IPO works on per-token mean log-probs (as TRL)
            pc, pr, rc, rr = pc / lengths[:, 0], pr / lengths[:, 1], rc / lengths[:, 0], rr / lengths[:, 1]
        return dpo_loss(pc, pr, rc, rr, hp.beta, hp.loss_type)
    avg_c, avg_r = pc / lengths[:, 0], pr / lengths[:, 1]
    if kind == "simpo":
        return simpo_loss(avg_c, avg_r, hp.beta, hp.simpo_gamma)
    if kind == "orpo":
        return orpo_loss(avg_c, avg_r, hp.beta)
    raise ValueError(f"not a preference-pair job type: {kind!r}")


def answer_lengths(pairs: Sequence[PairSample]) -> torch.Tensor:
    return torch.tensor([[len(p.chosen), len(p.rejected)] for p in pairs], dtype=torch.float32)


class PreferenceRecipe(Recipe):
    """What the preference recipes (DPO and its kin, KTO) share: no-grad passes over every sample
    batched as training batches them, the eval metrics, and the step's micro-batch accumulation."""

    def single_pass(self, lengths: list[int]) -> Iterator[list[int]]:
        """The micro-batches of one pass over samples of ``lengths`` (reference and eval log-probs)."""
        for step in dpo_schedule(
            lengths,
            packing=self.cfg.packing,
            capacity=self.cfg.max_tokens_per_pack,
            seed=self.hp.seed,
            epochs=1,
            per_step=self.hp.batch_size,
        ):
            yield from step

    @staticmethod
    def eval_metrics(losses: torch.Tensor, stats: dict[str, float]) -> dict[str, float]:
        return {
            "loss": float(losses.mean()),
            "accuracy": stats["reward_accuracy"],
            "margin": stats["reward_margin"],
        }

    @staticmethod
    def backward_part(
        losses: torch.Tensor, stats: dict[str, float], part: int, whole: int, stats_acc: dict[str, float]
    ) -> float:
        """Backward a micro-batch of ``part`` of the step's ``whole`` samples (its share of their
        mean loss), add its stats weighted alike to ``stats_acc``; its loss."""
        loss = losses.sum() / whole
        loss.backward()
        for k, v in stats.items():
            stats_acc[k] = stats_acc.get(k, 0.0) + v * part / whole
        return float(loss.detach())


class DPORecipe(PreferenceRecipe):
    """dpo, simpo and orpo jobs (``cfg.kind``)."""

    def setup(self) -> None:
        self.load_model(attn="flashmask" if self.cfg.packing else "sdpa")
        self.pairs = self.tokenize(self.cfg.records)
        self.eval_pairs = self.tokenize(self.cfg.eval_records or [])
        self.lengths = answer_lengths(self.pairs)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.schedule = self.step_schedule(dpo_schedule, [len(p) for p in self.pairs])
        self.needs_ref = self.cfg.kind == "dpo"
        self.ref = (
            self.reference("reference_logps", lambda: self.all_logps(self.pairs)) if self.needs_ref else None
        )
        self.make_optimizer()
        self.hooks.log(
            f"{self.cfg.kind}: {len(self.pairs)} pairs, {self.total_steps} steps, packing={self.cfg.packing}"
        )

    def tokenize(self, records: Sequence[dict[str, Any]]) -> list[PairSample]:
        return [tokenize_pair(self.tokenizer, r["prompt"], r["chosen"], r["rejected"]) for r in records]

    def all_logps(self, pairs: Sequence[PairSample]) -> torch.Tensor:
        """``[n_pairs, 2]`` summed (chosen, rejected) log-probs of the current model, no grad."""
        out = torch.zeros(len(pairs), 2)
        with torch.no_grad():
            for idx in self.single_pass([len(p) for p in pairs]):
                c, r = self._logps(pairs, idx)
                out[idx, 0], out[idx, 1] = c.float().cpu(), r.float().cpu()
        return out

    def _logps(self, pairs: Sequence[PairSample], idx: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        with self.autocast():
            if self.cfg.packing:
                pack = pack_pairs(
                    pairs, idx, pad_id=self.pad_id, pad_to_multiple_of=self.cfg.pad_to_multiple_of
                )
                return pack_pair_logps(self.model, pack)
            return padded_pair_logps(self.model, padded_pair_batch(pairs, idx, self.pad_id))

    def evaluate(self) -> dict[str, float]:
        eval_ref = None
        if self.needs_ref:
            eval_ref = self.reference("reference_logps_eval", lambda: self.all_logps(self.eval_pairs))
        logps = self.all_logps(self.eval_pairs)
        losses, stats = pair_losses(
            self.cfg.kind, self.hp, logps[:, 0], logps[:, 1], answer_lengths(self.eval_pairs), eval_ref
        )
        return self.eval_metrics(losses, stats)

    def train_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        micro = self.schedule[step - 1]
        n_pairs = sum(len(m) for m in micro)
        real = processed = 0
        loss_total = 0.0
        stats_acc: dict[str, float] = {}
        for idx in micro:
            if self.cfg.packing:
                pack = pack_pairs(
                    self.pairs, idx, pad_id=self.pad_id, pad_to_multiple_of=self.cfg.pad_to_multiple_of
                )
                real += pack.real_tokens
                processed += pack.total_tokens
                with self.autocast():
                    pc, pr = pack_pair_logps(self.model, pack)
            else:
                batch = padded_pair_batch(self.pairs, idx, self.pad_id)
                real += sum(len(self.pairs[i]) for i in idx)
                processed += int(batch["attention_mask"].numel())
                with self.autocast():
                    pc, pr = padded_pair_logps(self.model, batch)
            rows = list(idx)
            ref = None if self.ref is None else self.ref[rows].to(pc.device)
            losses, stats = pair_losses(
                self.cfg.kind, self.hp, pc.float(), pr.float(), self.lengths[rows].to(pc.device), ref
            )
            loss_total += self.backward_part(losses, stats, len(idx), n_pairs, stats_acc)
        return self.finish_step(t0, loss_total, real, processed, stats_acc)
