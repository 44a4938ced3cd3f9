"""PPO and GRPO on prompts with a reward.

Each step: sample completions for a batch of prompts with the inference engine
(GRPO: ``group_size`` per prompt), score them, then compute with the current
weights (no grad) the old log-probs, the reference log-probs (adapter switched off
for LoRA, a frozen copy for a full fine-tune) and, for PPO, the values; then
``ppo_epochs`` clipped updates. Prompt+completion sequences are packed with the
document mask, like SFT samples, so scoring and updates run without padding.

- GRPO: advantage = (reward - group mean) / group std, the same for every token of a
  completion; loss = clipped surrogate + ``kl_coef`` x KL(policy || reference), token mean.
- PPO: actor and critic share the trunk (a value head on the last hidden state);
  per-token reward = -``kl_coef`` x (log pi - log ref), plus the score on the last
  token; GAE(``gamma``, ``lam``) gives advantages (whitened) and returns; loss =
  clipped surrogate + ``vf_coef`` x clipped value loss.
"""

from __future__ import annotations

import copy
import math
import random
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from services.trainer.data.packing import best_fit_decreasing, pack_sft
from services.trainer.data.tokenize import SFTSample, tokenize_prompt
from services.trainer.losses import clipped_policy_loss, clipped_value_loss, gae, group_advantages, kl_k3
from services.trainer.modeling import gather_logps, hidden_states
from services.trainer.recipes.base import Recipe
from services.trainer.rollout import EngineRollouts, Rollout

# seeds of consecutive steps' rollouts lie this far apart (more than a step's samples)
ROLLOUT_SEED_STRIDE = 1_000_003


@dataclass
class Batch:
    """Per completion: its token log-probs etc. as 1-D tensors (completion tokens only)."""

    rollouts: list[Rollout]
    rewards: torch.Tensor
    old_logps: list[torch.Tensor]
    ref_logps: list[torch.Tensor]
    old_values: list[torch.Tensor]
    advantages: list[torch.Tensor]
    returns: list[torch.Tensor]


class RLRecipe(Recipe):
    algo = "grpo"

    def setup(self) -> None:
        self.load_model(attn="flashmask")
        self.prompts = [tokenize_prompt(self.tokenizer, r.prompt) for r in self.cfg.records]
        if self.cfg.reward is None:
            raise ValueError(f"{self.algo} needs a reward")
        self.reward_fn = self.cfg.reward
        self.group = self.hp.group_size if self.algo == "grpo" else 1
        per_epoch = math.ceil(len(self.prompts) / self.hp.prompts_per_step)
        self.total_steps = min(
            per_epoch * self.hp.n_epochs, self.hp.max_steps or per_epoch * self.hp.n_epochs
        )
        self.value_head: nn.Module | None = None
        if self.algo == "ppo":
            hidden = int(self.model.config.hidden_size)
            self.value_head = nn.Linear(hidden, 1).to(self.device)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)
        self.ref_model: Any = None
        if self.cfg.lora is None:
            self.ref_model = copy.deepcopy(self.model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self.rollouts = EngineRollouts(self.model, self.tokenizer, self.device)
        self.make_optimizer()
        self.hooks.log(
            f"{self.algo}: {len(self.prompts)} prompts, {self.total_steps} steps, group {self.group}"
        )

    def trainable_modules(self) -> list[nn.Module]:
        return [self.model] if self.value_head is None else [self.model, self.value_head]

    def prompt_indices(self, step: int) -> list[int]:
        """The prompts of ``step``: a per-epoch shuffle (a pure function of the seed), wrapping around."""
        n = len(self.prompts)
        k = self.hp.prompts_per_step
        out = []
        for j in range((step - 1) * k, step * k):
            epoch, pos = divmod(j, n)
            order = list(range(n))
            random.Random(self.hp.seed + epoch).shuffle(order)
            out.append(order[pos])
        return out

    # ---- scoring a batch of sequences with the document mask
    def _sequences(self, rollouts: list[Rollout]) -> list[SFTSample]:
        return [
            SFTSample(r.prompt_ids + r.completion_ids, [-100] * len(r.prompt_ids) + r.completion_ids)
            for r in rollouts
        ]

    def _packs(self, seqs: list[SFTSample]) -> list[list[int]]:
        return best_fit_decreasing([len(s) for s in seqs], self.cfg.max_tokens_per_pack)

    def _score(
        self, model: Any, seqs: list[SFTSample], plan: list[list[int]], *, with_values: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per sequence: completion-token log-probs (and values), keeping the graph if grad is on."""
        logps: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
        values: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
        for idx in plan:
            pack = pack_sft(seqs, idx, pad_id=int(self.tokenizer.pad_token_id))
            with self.autocast():
                h = hidden_states(
                    model,
                    pack.input_ids.to(self.device),
                    position_ids=pack.position_ids.to(self.device),
                    startend_row_indices=pack.mask().to(self.device),
                )
                flat = pack.labels.reshape(-1)
                pos = (flat != -100).nonzero().squeeze(-1)
                lp = gather_logps(model, h, pos, flat[pos]).float()
                v = None
                if with_values and self.value_head is not None:
                    # The critic reads the policy's features detached: its regression loss must not
                    # move the shared trunk (that destabilises the policy on small batches).
                    feats = h.detach().reshape(-1, h.shape[-1]).index_select(0, pos.to(h.device)).float()
                    v = self.value_head(feats).squeeze(-1)
            start = 0
            for i in idx:
                n = len(seqs[i].labels) - seqs[i].labels.count(-100)
                logps[i] = lp[start : start + n]
                if v is not None:
                    values[i] = v[start : start + n]
                start += n
        return logps, values

    def _ref_ctx(self) -> AbstractContextManager[Any]:
        return self.model.disable_adapter() if self.ref_model is None else nullcontext()

    # ---- one step
    def train_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        idx = self.prompt_indices(step)
        records = [self.cfg.records[i] for i in idx for _ in range(self.group)]
        rollouts = self.rollouts.generate(
            [self.prompts[i] for i in idx],
            n=self.group,
            max_new_tokens=self.hp.max_new_tokens,
            temperature=self.hp.temperature,
            top_p=self.hp.top_p,
            # Reproducible runs: the engine seeds sample j of prompt i with seed + i * n + j, so
            # every completion of a step draws its own stream; steps are spaced apart.
            seed=(self.hp.seed + step * ROLLOUT_SEED_STRIDE) % 2**31,
        )
        t_gen = time.perf_counter() - t0
        rewards = torch.tensor(self.reward_fn(records, [r.text for r in rollouts]), dtype=torch.float32)
        keep = [i for i, r in enumerate(rollouts) if r.completion_ids]
        seqs = self._sequences(rollouts)
        plan = self._packs([seqs[i] for i in keep])
        plan = [[keep[j] for j in p] for p in plan]
        with torch.no_grad():
            self.model.eval()
            old_logps, old_values = self._score(self.model, seqs, plan, with_values=True)
            ref_model = self.ref_model if self.ref_model is not None else self.model
            with self._ref_ctx():
                ref_logps, _ = self._score(ref_model, seqs, plan, with_values=False)
            self.model.train()
        advantages, returns = self._advantages(rewards, keep, old_logps, ref_logps, old_values)
        n_tokens = sum(old_logps[i].numel() for i in keep)
        stats: dict[str, float] = {}
        lr = self.lr()
        grad_norm = 0.0
        for epoch in range(self.hp.ppo_epochs):
            if not keep:
                break
            stats = self._update(
                seqs, plan, keep, old_logps, ref_logps, old_values, advantages, returns, n_tokens
            )
            grad_norm = self.optimizer_step(advance_schedule=epoch == self.hp.ppo_epochs - 1)
        if not keep:
            self.scheduler.step()
        self.platform.synchronize()
        dt = time.perf_counter() - t0
        kl = (
            float(sum(float((old_logps[i] - ref_logps[i]).sum()) for i in keep) / max(n_tokens, 1))
            if keep
            else 0.0
        )
        return {
            "reward": float(rewards.mean()),
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "kl": kl,
            "learning_rate": lr,
            "grad_norm": grad_norm,
            "completion_tokens": float(n_tokens) / max(len(rollouts), 1),
            "tokens_per_s": sum(len(s) for s in seqs) / dt,
            "rollout_s": t_gen,
            **stats,
        }

    def _advantages(
        self,
        rewards: torch.Tensor,
        keep: list[int],
        old_logps: list[torch.Tensor],
        ref_logps: list[torch.Tensor],
        old_values: list[torch.Tensor],
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        n = rewards.numel()
        adv: list[torch.Tensor] = [torch.empty(0)] * n
        ret: list[torch.Tensor] = [torch.empty(0)] * n
        if self.algo == "grpo":
            a = group_advantages(rewards, self.group)
            for i in keep:
                adv[i] = torch.full_like(old_logps[i], float(a[i]))
            return adv, ret
        for i in keep:
            token_rewards = -self.hp.kl_coef * (old_logps[i] - ref_logps[i])
            token_rewards[-1] += rewards[i].to(token_rewards.device)
            adv[i], ret[i] = gae(token_rewards, old_values[i], self.hp.gamma, self.hp.lam)
        if keep:
            flat = torch.cat([adv[i] for i in keep])
            mean, std = flat.mean(), flat.std() if flat.numel() > 1 else torch.tensor(1.0)
            for i in keep:
                adv[i] = (adv[i] - mean) / (std + 1e-8)
        return adv, ret

    def _update(
        self,
        seqs: list[SFTSample],
        plan: list[list[int]],
        keep: list[int],
        old_logps: list[torch.Tensor],
        ref_logps: list[torch.Tensor],
        old_values: list[torch.Tensor],
        advantages: list[torch.Tensor],
        returns: list[torch.Tensor],
        n_tokens: int,
    ) -> dict[str, float]:
        pg_total = vf_total = kl_total = clip_total = 0.0
        for pack_idx in plan:
            logps, values = self._score(self.model, seqs, [pack_idx], with_values=True)
            lp = torch.cat([logps[i] for i in pack_idx])
            old = torch.cat([old_logps[i] for i in pack_idx]).to(lp.device)
            ref = torch.cat([ref_logps[i] for i in pack_idx]).to(lp.device)
            adv = torch.cat([advantages[i] for i in pack_idx]).to(lp.device)
            pg, clipped = clipped_policy_loss(lp, old, adv, self.hp.clip_range)
            loss = pg.sum() / n_tokens
            pg_total += float(pg.detach().sum()) / n_tokens
            clip_total += float(clipped.sum()) / n_tokens
            if self.algo == "grpo":
                kl = kl_k3(lp, ref)
                loss = loss + self.hp.kl_coef * kl.sum() / n_tokens
                kl_total += float(kl.detach().sum()) / n_tokens
            else:
                v = torch.cat([values[i] for i in pack_idx])
                vf = clipped_value_loss(
                    v,
                    torch.cat([old_values[i] for i in pack_idx]).to(v.device),
                    torch.cat([returns[i] for i in pack_idx]).to(v.device),
                    self.hp.clip_range,
                )
                loss = loss + self.hp.vf_coef * vf.sum() / n_tokens
                vf_total += float(vf.detach().sum()) / n_tokens
            loss.backward()
        stats = {
            "loss": pg_total
            + (self.hp.kl_coef * kl_total if self.algo == "grpo" else self.hp.vf_coef * vf_total),
            "pg_loss": pg_total,
            "clip_frac": clip_total,
        }
        if self.algo == "ppo":
            stats["vf_loss"] = vf_total
        return stats


class GRPORecipe(RLRecipe):
    algo = "grpo"


class PPORecipe(RLRecipe):
    algo = "ppo"
