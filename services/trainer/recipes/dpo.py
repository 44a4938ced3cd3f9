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
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from services.trainer.data.formats import PreferenceRecord
from services.trainer.data.packing import Pack, pack_pairs, pair_logit_index, plan_packs
from services.trainer.data.tokenize import PairSample, tokenize_pair
from services.trainer.losses import dpo_loss, orpo_loss, segment_sums, simpo_loss
from services.trainer.modeling import label_logps
from services.trainer.recipes.base import Recipe


def pack_pair_logps(model: Any, pack: Pack) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed answer log-probs (chosen, rejected), one per pair of the pack, pack order
    (``model``: the LM or the data-parallel wrapper, see ``modeling.label_logps``)."""
    src, tgt_pos, seg = pair_logit_index(pack.triples)
    targets = pack.input_ids.reshape(-1)[tgt_pos]
    logps = label_logps(
        model, pack.input_ids, src, targets, position_ids=pack.position_ids, startend_row_indices=pack.mask()
    )
    sums = segment_sums(logps, seg, 2 * len(pack.triples))
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
    flat = batch["labels"].reshape(-1)
    pos = (flat != -100).nonzero().squeeze(-1)
    rows = pos // batch["labels"].shape[1]
    logps = label_logps(model, batch["input_ids"], pos, flat[pos], attention_mask=batch["attention_mask"])
    sums = segment_sums(logps, rows, batch["labels"].shape[0])
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

    pad_id: int  # set by the recipe's setup

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

    def backward_part(
        self,
        losses: torch.Tensor,
        stats: dict[str, float],
        part: int,
        whole: int,
        stats_acc: dict[str, float],
    ) -> float:
        """Backward a micro-batch of ``part`` of the step's ``whole`` samples (its share of their
        mean loss), add its stats weighted alike to ``stats_acc``; its loss. Under torchrun the
        backward is scaled by the world size: DDP and FSDP average the ranks' gradients, so the
        average is their sum, the gradient of one process on the step's whole batch."""
        loss = losses.sum() / whole
        (loss * (1 if self.dist is None else self.dist.world)).backward()
        for k, v in stats.items():
            stats_acc[k] = stats_acc.get(k, 0.0) + v * part / whole
        return float(loss.detach())

    # ---- data parallel (cfg.dist): each rank its share of a step's micro-batches
    def my_micro(self, micro: list[list[int]]) -> list[list[int] | None]:
        """This rank's micro-batches of a step: all of them in one process; under torchrun the
        packs dealt round-robin, or the rows of the unpacked batch split round-robin, padded
        with ``None`` (a filler pass) so every rank makes as many passes."""
        if self.dist is None:
            return list(micro)
        if self.cfg.packing:
            return list(self.dist.share(micro))
        mine = micro[0][self.dist.rank :: self.dist.world]
        return [mine or None]

    def sync_grads(self, k: int, n: int) -> AbstractContextManager[Any]:
        """Gradients are all-reduced on the rank's last micro-batch of the step only."""
        return nullcontext() if self.dist is None else self.dist.sync_grads(last=k == n - 1)

    def backward_filler(self) -> None:
        assert self.dist is not None
        with self.autocast():
            logps = self.dist.filler(self.pad_id)
        (logps.sum() * 0.0).backward()

    def finish_pref_step(
        self, t0: float, loss: float, real: int, processed: int, stats: dict[str, float]
    ) -> dict[str, float]:
        """The step's metrics: under torchrun the ranks' shares summed (each stat is already
        weighted by its rows' share of the step)."""
        if self.dist is not None:
            loss, real_f, processed_f = self.dist.sum(loss, real, processed)
            real, processed = int(real_f), int(processed_f)
            stats = self.dist.sum_stats(stats)
        return self.finish_step(t0, loss, real, processed, stats)

    def no_grad_pass(
        self,
        n_rows: int,
        lengths: list[int],
        rows_of: Callable[[list[int]], list[int]],
        logps_of: Callable[[list[int]], torch.Tensor],
    ) -> torch.Tensor:
        """``[n_rows, 2]`` log-prob sums of one no-grad pass (micro-batches as ``single_pass``).
        Once wrapped under torchrun, each rank computes its share of the micro-batches (the
        forwards of a sharded model are collective) and the rows are summed over the ranks;
        before wrapping (the reference, in ``setup``) every rank computes all of them."""
        out = torch.zeros(n_rows, 2)
        batches = list(self.single_pass(lengths))
        sharded = self.dist is not None and self.dist.dp is not None
        with torch.no_grad():
            for idx in self.dist.share(batches) if sharded else batches:
                if idx is None:
                    with self.autocast():
                        self.dist.filler(self.pad_id)
                    continue
                out[rows_of(idx)] = logps_of(idx).float().cpu()
        return self.dist.sum_tensor(out) if sharded else out


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

    def tokenize(self, records: Sequence[PreferenceRecord]) -> list[PairSample]:
        return [tokenize_pair(self.tokenizer, r.prompt, r.chosen, r.rejected) for r in records]

    def all_logps(self, pairs: Sequence[PairSample]) -> torch.Tensor:
        """``[n_pairs, 2]`` summed (chosen, rejected) log-probs of the current model, no grad."""
        return self.no_grad_pass(
            len(pairs), [len(p) for p in pairs], list, lambda idx: torch.stack(self._logps(pairs, idx), dim=1)
        )

    def _logps(self, pairs: Sequence[PairSample], idx: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        with self.autocast():
            if self.cfg.packing:
                pack = pack_pairs(
                    pairs, idx, pad_id=self.pad_id, pad_to_multiple_of=self.cfg.pad_to_multiple_of
                )
                return pack_pair_logps(self.lm, pack)
            return padded_pair_logps(self.lm, padded_pair_batch(pairs, idx, self.pad_id))

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
        mine = self.my_micro(micro)
        for k, idx in enumerate(mine):
            with self.sync_grads(k, len(mine)):
                if idx is None:
                    self.backward_filler()
                    continue
                if self.cfg.packing:
                    pack = pack_pairs(
                        self.pairs, idx, pad_id=self.pad_id, pad_to_multiple_of=self.cfg.pad_to_multiple_of
                    )
                    real += pack.real_tokens
                    processed += pack.total_tokens
                    with self.autocast():
                        pc, pr = pack_pair_logps(self.lm, pack)
                else:
                    batch = padded_pair_batch(self.pairs, idx, self.pad_id)
                    real += sum(len(self.pairs[i]) for i in idx)
                    processed += int(batch["attention_mask"].numel())
                    with self.autocast():
                        pc, pr = padded_pair_logps(self.lm, batch)
                rows = list(idx)
                ref = None if self.ref is None else self.ref[rows].to(pc.device)
                losses, stats = pair_losses(
                    self.cfg.kind, self.hp, pc.float(), pr.float(), self.lengths[rows].to(pc.device), ref
                )
                loss_total += self.backward_part(losses, stats, len(idx), n_pairs, stats_acc)
        return self.finish_pref_step(t0, loss_total, real, processed, stats_acc)
