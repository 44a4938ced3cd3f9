"""DPO (sigmoid loss with ``beta``): pairs packed with the prompt once per pair.

The reference model's log-probs do not change during training, so they are computed
once, before the first update, for every pair (with the adapter switched off for
LoRA; for a full fine-tune the untouched model is the reference at that moment) and
kept in a cache file next to the checkpoints, which a resumed job reuses.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from services.trainer.data.packing import Pack, pack_pairs, pair_logit_index, plan_packs
from services.trainer.data.tokenize import PairSample, tokenize_pair
from services.trainer.losses import dpo_loss, segment_sums
from services.trainer.modeling import gather_logps, hidden_states
from services.trainer.recipes.base import Recipe


def pack_pair_logps(model: Any, pack: Pack) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed answer log-probs (chosen, rejected), one per pair of the pack, pack order."""
    device = next(model.parameters()).device
    h = hidden_states(
        model,
        pack.input_ids.to(device),
        position_ids=pack.position_ids.to(device),
        startend_row_indices=pack.mask().to(device),
    )
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


class DPORecipe(Recipe):
    def setup(self) -> None:
        self.load_model(attn="flashmask" if self.cfg.packing else "sdpa")
        self.pairs = [
            tokenize_pair(self.tokenizer, r["prompt"], r["chosen"], r["rejected"]) for r in self.cfg.records
        ]
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.schedule = dpo_schedule(
            [len(p) for p in self.pairs],
            packing=self.cfg.packing,
            capacity=self.cfg.max_tokens_per_pack,
            seed=self.hp.seed,
            epochs=self.hp.n_epochs,
            per_step=self.hp.packs_per_step if self.cfg.packing else self.hp.batch_size,
        )
        self.total_steps = min(len(self.schedule), self.hp.max_steps or len(self.schedule))
        self.ref = self.reference_logps()
        self.make_optimizer()
        self.hooks.log(f"dpo: {len(self.pairs)} pairs, {self.total_steps} steps, packing={self.cfg.packing}")

    def _ref_cache(self) -> Any:
        return None if self.cfg.work_dir is None else self.cfg.work_dir / "reference_logps.pt"

    def reference_logps(self) -> torch.Tensor:
        """``[n_pairs, 2]`` reference (chosen, rejected) log-probs, computed once and cached."""
        cache = self._ref_cache()
        if cache is not None and cache.is_file():
            return torch.load(cache)
        ref = torch.zeros(len(self.pairs), 2)
        ctx = self.model.disable_adapter() if self.cfg.lora is not None else _nullcontext()
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad(), ctx:
            groups = dpo_schedule(
                [len(p) for p in self.pairs],
                packing=self.cfg.packing,
                capacity=self.cfg.max_tokens_per_pack,
                seed=self.hp.seed,
                epochs=1,
                per_step=self.hp.batch_size,
            )
            for step in groups:
                for idx in step:
                    c, r = self._logps(idx)
                    ref[idx, 0], ref[idx, 1] = c.float().cpu(), r.float().cpu()
        self.model.train(was_training)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(".tmp")
            torch.save(ref, tmp)
            tmp.replace(cache)
        return ref

    def _logps(self, idx: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        with self.autocast():
            if self.cfg.packing:
                pack = pack_pairs(
                    self.pairs, idx, pad_id=self.pad_id, pad_to_multiple_of=self.cfg.pad_to_multiple_of
                )
                return pack_pair_logps(self.model, pack)
            return padded_pair_logps(self.model, padded_pair_batch(self.pairs, idx, self.pad_id))

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
            ref = self.ref[list(idx)].to(pc.device)
            losses, stats = dpo_loss(pc.float(), pr.float(), ref[:, 0], ref[:, 1], self.hp.beta)
            loss = losses.sum() / n_pairs
            loss.backward()
            loss_total += float(loss.detach())
            for k, v in stats.items():
                stats_acc[k] = stats_acc.get(k, 0.0) + v * len(idx) / n_pairs
        lr = self.lr()
        grad_norm = self.optimizer_step()
        self.platform.synchronize()
        dt = time.perf_counter() - t0
        return {
            "loss": loss_total,
            "learning_rate": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": real / dt,
            "padding_ratio": 1 - real / max(processed, 1),
            **stats_acc,
        }


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
