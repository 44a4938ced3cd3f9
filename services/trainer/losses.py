"""Losses and advantage estimators of the recipes (pure tensor functions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sft_loss(logps: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Token-mean negative log-likelihood; ``n_tokens`` counts the label tokens of the whole
    optimizer step, so accumulating packs of different sizes still gives the token mean."""
    return -logps.sum() / max(n_tokens, 1)


def segment_sums(values: torch.Tensor, segments: torch.Tensor, n_segments: int) -> torch.Tensor:
    out = values.new_zeros(n_segments)
    return out.index_add(0, segments.to(values.device), values)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sigmoid DPO (Rafailov et al.) on summed answer log-probs; returns per-pair losses."""
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    margin = chosen_reward - rejected_reward
    losses = -F.logsigmoid(margin)
    stats = {
        "reward_margin": float(margin.detach().mean()),
        "reward_accuracy": float((margin.detach() > 0).float().mean()),
        "chosen_reward": float(chosen_reward.detach().mean()),
        "rejected_reward": float(rejected_reward.detach().mean()),
    }
    return losses, stats


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO: each completion's reward against its group's mean, scaled by the group's std."""
    g = rewards.view(-1, group_size)
    adv = (g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over one completion's tokens (1-D tensors).

    The value after the last token is 0 (the episode ends). Returns (advantages, returns).
    """
    n = rewards.shape[0]
    adv = torch.zeros_like(rewards)
    last = rewards.new_zeros(())
    for t in range(n - 1, -1, -1):
        next_value = values[t + 1] if t + 1 < n else rewards.new_zeros(())
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, adv + values


def clipped_policy_loss(
    logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token (to be averaged by the caller); also the clip indicator."""
    ratio = torch.exp(logps - old_logps)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip, 1 + clip) * advantages
    return -torch.minimum(unclipped, clipped), (unclipped != clipped).float()


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> torch.Tensor:
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate (Schulman's k3: unbiased, always >= 0)."""
    d = ref_logps - logps
    return torch.exp(d) - d - 1
