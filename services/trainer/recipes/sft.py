"""Supervised fine-tuning: token-mean loss on assistant tokens, packed or padded."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from services.trainer.data.formats import ChatRecord
from services.trainer.data.packing import Pack, pack_sft, plan_packs
from services.trainer.data.tokenize import IGNORE, SFTSample, tokenize_sft
from services.trainer.losses import sft_loss
from services.trainer.modeling import gather_logps, hidden_states, label_positions, pack_hidden_states
from services.trainer.recipes.base import Recipe


def pack_logps(model: Any, pack: Pack) -> tuple[torch.Tensor, int]:
    """Log-probs of every label token of a pack (FlashMask document mask); and their count."""
    h = pack_hidden_states(model, pack)
    pos, tgt = label_positions(pack.labels)
    return gather_logps(model, h, pos, tgt), int(pos.numel())


def pad_batch(samples: Sequence[SFTSample], indices: Sequence[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch to the longest sample, with shifted labels (the unpacked baseline)."""
    longest = max(len(samples[i]) for i in indices)
    ids = torch.full((len(indices), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(indices), longest), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(indices), longest), dtype=torch.long)
    for row, i in enumerate(indices):
        s = samples[i]
        n = len(s)
        ids[row, :n] = torch.tensor(s.input_ids)
        labels[row, : n - 1] = torch.tensor(s.labels[1:])
        mask[row, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def padded_logps(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    device = next(model.parameters()).device
    h = hidden_states(model, batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
    pos, tgt = label_positions(batch["labels"])
    return gather_logps(model, h, pos, tgt), int(pos.numel())


def tokenize_all(tokenizer: Any, records: Sequence[ChatRecord]) -> list[SFTSample]:
    return [tokenize_sft(tokenizer, r.messages) for r in records]


def sft_schedule(
    lengths: Sequence[int], *, packing: bool, capacity: int, seed: int, epochs: int, per_step: int
) -> list[list[list[int]]]:
    """Steps -> micro-batches -> sample indices. A pure function of the seed, so a
    resumed job finds its data position from the step number alone."""
    steps: list[list[list[int]]] = []
    for epoch in range(epochs):
        if packing:
            micro = plan_packs(lengths, capacity, seed=seed + epoch)
        else:
            order = list(range(len(lengths)))
            random.Random(seed + epoch).shuffle(order)
            micro = [order[i : i + per_step] for i in range(0, len(order), per_step)]
        per = per_step if packing else 1
        steps += [micro[i : i + per] for i in range(0, len(micro), per)]
    return steps


class SFTRecipe(Recipe):
    def setup(self) -> None:
        self.load_model(attn="flashmask" if self.cfg.packing else "sdpa")
        self.samples = [
            s for s in tokenize_all(self.tokenizer, self.cfg.records) if any(x != IGNORE for x in s.labels)
        ]
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.schedule = self.step_schedule(sft_schedule, [len(s) for s in self.samples])
        self.eval_samples = tokenize_all(self.tokenizer, self.cfg.eval_records or [])
        self.make_optimizer()
        self.hooks.log(
            f"sft: {len(self.samples)} samples, {self.total_steps} steps, packing={self.cfg.packing}"
        )

    def _dp_logps(self, batch: Pack | dict[str, torch.Tensor] | None) -> tuple[torch.Tensor, int]:
        """Through the data-parallel wrapper (decoder and head in one forward); ``None`` is
        a rank's filler pass: one pad token, whose log-prob the caller multiplies by 0."""
        assert self.dist is not None
        dev = self.dist.device
        if batch is None:
            return self.dist.filler(self.pad_id), 0
        if isinstance(batch, Pack):
            pos, tgt = label_positions(batch.labels)
            logps = self.dist.dp(
                batch.input_ids.to(dev),
                pos.to(dev),
                tgt.to(dev),
                position_ids=batch.position_ids.to(dev),
                startend_row_indices=batch.mask().to(dev),
            )
            return logps, int(pos.numel())
        pos, tgt = label_positions(batch["labels"])
        logps = self.dist.dp(
            batch["input_ids"].to(dev),
            pos.to(dev),
            tgt.to(dev),
            attention_mask=batch["attention_mask"].to(dev),
        )
        return logps, int(pos.numel())

    def _rank_batches(
        self, micro: list[list[int]]
    ) -> tuple[list[Pack | dict[str, torch.Tensor] | None], int]:
        """This rank's share of a step (packs, or a slice of the unpacked batch), each packed
        here; and the label tokens of the whole step (known from the samples, no forward)."""
        assert self.dist is not None
        if not hasattr(self, "_label_count"):
            self._label_count = [sum(1 for x in s.labels[1:] if x != IGNORE) for s in self.samples]
        n_tokens = sum(self._label_count[i] for idx in micro for i in idx)
        out: list[Pack | dict[str, torch.Tensor] | None] = []
        if self.cfg.packing:
            for idx in self.dist.share(micro):
                out.append(
                    None
                    if idx is None
                    else pack_sft(
                        self.samples, idx, pad_id=self.pad_id, pad_to_multiple_of=self.cfg.pad_to_multiple_of
                    )
                )
        else:
            mine = micro[0][self.dist.rank :: self.dist.world]
            out.append(pad_batch(self.samples, mine, self.pad_id) if mine else None)
        return out, n_tokens

    def _train_step_dp(self, step: int) -> dict[str, float]:
        assert self.dist is not None
        t0 = time.perf_counter()
        batches, n_tokens = self._rank_batches(self.schedule[step - 1])
        real = processed = 0
        loss_total = 0.0
        for k, b in enumerate(batches):
            with self.dist.sync_grads(last=k == len(batches) - 1):
                with self.autocast():
                    logps, _ = self._dp_logps(b)
                if b is None:
                    loss = logps.sum() * 0.0
                else:
                    loss = sft_loss(logps, n_tokens)
                    if isinstance(b, Pack):
                        real, processed = real + b.real_tokens, processed + b.total_tokens
                    else:
                        real += int(b["attention_mask"].sum())
                        processed += int(b["attention_mask"].numel())
                # DDP and FSDP average the ranks' gradients: scaled so the average is the sum
                (loss * self.dist.world).backward()
                loss_total += float(loss.detach())
        loss_total, real_f, processed_f = self.dist.sum(loss_total, real, processed)
        return self.finish_step(
            t0, loss_total, int(real_f), int(processed_f), {"label_tokens": float(n_tokens)}
        )

    def train_step(self, step: int) -> dict[str, float]:
        if self.dist is not None:
            return self._train_step_dp(step)
        t0 = time.perf_counter()
        micro = self.schedule[step - 1]
        if self.cfg.packing:
            packs = [
                pack_sft(
                    self.samples, idx, pad_id=self.pad_id, pad_to_multiple_of=self.cfg.pad_to_multiple_of
                )
                for idx in micro
            ]
            real = sum(p.real_tokens for p in packs)
            processed = sum(p.total_tokens for p in packs)
            n_tokens = sum(int((p.labels != IGNORE).sum()) for p in packs)
            loss_total = 0.0
            for p in packs:
                with self.autocast():
                    logps, _ = pack_logps(self.model, p)
                loss = sft_loss(logps, n_tokens)
                loss.backward()
                loss_total += float(loss.detach())
        else:
            batch = pad_batch(self.samples, micro[0], self.pad_id)
            real = int(batch["attention_mask"].sum())
            processed = int(batch["attention_mask"].numel())
            with self.autocast():
                logps, n_tokens = padded_logps(self.model, batch)
            loss = sft_loss(logps, n_tokens)
            loss.backward()
            loss_total = float(loss.detach())
        return self.finish_step(t0, loss_total, real, processed, {"label_tokens": float(n_tokens)})

    def evaluate(self) -> dict[str, float]:
        return {"loss": self.eval_loss()}

    @torch.no_grad()
    def eval_loss(self) -> float:
        """Token-mean loss on the eval dataset."""
        was_training = self.model.training
        self.model.eval()
        total, count = 0.0, 0
        if self.dist is not None:
            # each rank its share of the rows (every rank as many passes), summed over ranks
            for i in self.dist.share(list(range(len(self.eval_samples)))):
                with self.autocast():
                    if i is None:
                        self._dp_logps(None)
                        continue
                    if self.cfg.packing:
                        logps, n = self._dp_logps(pack_sft(self.eval_samples, [i], pad_id=self.pad_id))
                    else:
                        logps, n = self._dp_logps(pad_batch(self.eval_samples, [i], self.pad_id))
                total -= float(logps.sum())
                count += n
            total, count_f = self.dist.sum(total, count)
            self.model.train(was_training)
            return total / max(count_f, 1)
        for i in range(len(self.eval_samples)):
            with self.autocast():
                if self.cfg.packing:
                    logps, n = pack_logps(self.model, pack_sft(self.eval_samples, [i], pad_id=self.pad_id))
                else:
                    logps, n = padded_logps(self.model, pad_batch(self.eval_samples, [i], self.pad_id))
            total -= float(logps.sum())
            count += n
        self.model.train(was_training)
        return total / max(count, 1)
