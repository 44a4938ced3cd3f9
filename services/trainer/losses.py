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


def _pair_stats(chosen_reward: torch.Tensor, rejected_reward: torch.Tensor) -> dict[str, float]:
    margin = (chosen_reward - rejected_reward).detach()
    return {
        "reward_margin": float(margin.mean()),
        "reward_accuracy": float((margin > 0).float().mean()),
        "chosen_reward": float(chosen_reward.detach().mean()),
        "rejected_reward": float(rejected_reward.detach().mean()),
    }


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-pair DPO-family losses on answer log-probs, with ``h = (pi_c - ref_c) - (pi_r - ref_r)``:

    - ``sigmoid`` (DPO, Rafailov et al. 2023): ``-log sigmoid(beta * h)``;
    - ``ipo`` (Azar et al. 2023): ``(h - 1 / (2 beta))^2``; the caller passes length-normalised
      (per-token mean) log-probs, as TRL does;
    - ``hinge`` (SLiC, Zhao et al. 2023): ``max(0, 1 - beta * h)``.
    """
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}")
    return losses, _pair_stats(chosen_reward, rejected_reward)


def simpo_loss(
    avg_chosen: torch.Tensor, avg_rejected: torch.Tensor, beta: float, gamma: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """SimPO (Meng et al. 2024), reference-free, on per-token mean log-probs:
    ``-log sigmoid(beta * avg_c - beta * avg_r - gamma)``; rewards are ``beta * avg``."""
    chosen_reward = beta * avg_chosen
    rejected_reward = beta * avg_rejected
    losses = -F.logsigmoid(chosen_reward - rejected_reward - gamma)
    return losses, _pair_stats(chosen_reward, rejected_reward)


def _log1m_exp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``; capped just below 0 so a (near) certain answer
    gives a large finite odds instead of inf."""
    return torch.log1p(-torch.exp(x.clamp(max=-1e-6)))


def orpo_loss(
    avg_chosen: torch.Tensor, avg_rejected: torch.Tensor, lam: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """ORPO (Hong et al. 2024), reference-free, on per-token mean log-probs ``a``:
    ``NLL_chosen - lam * log sigmoid(log odds(a_c) - log odds(a_r))`` with
    ``log odds(a) = a - log(1 - exp(a))`` and ``NLL_chosen = -a_c``; rewards ``lam * a``
    (TRL's, where ``lam`` is called ``beta``)."""
    log_odds = (avg_chosen - avg_rejected) - (_log1m_exp(avg_chosen) - _log1m_exp(avg_rejected))
    ratio = F.logsigmoid(log_odds)
    nll = -avg_chosen
    losses = nll - lam * ratio
    stats = _pair_stats(lam * avg_chosen, lam * avg_rejected)
    stats["nll"] = float(nll.detach().mean())
    stats["log_odds_ratio"] = float(log_odds.detach().mean())
    return losses, stats


def kto_kl(policy_kl: torch.Tensor, ref_kl: torch.Tensor) -> torch.Tensor:
    """KTO's reference point: the batch's mean log-ratio on *mismatched* completions (each
    prompt with another row's completion), clamped at 0 and detached (no gradient flows
    through it, as in TRL and the paper)."""
    if policy_kl.numel() == 0:
        return policy_kl.new_zeros(())
    return (policy_kl - ref_kl).mean().clamp(min=0).detach()


def kto_loss(
    policy: torch.Tensor,
    ref: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KTO (Ethayarajh et al. 2024) per row, ``r = pi - ref`` (summed completion log-probs):
    desirable ``w_d * (1 - sigmoid(beta (r - kl)))``, undesirable ``w_u * (1 - sigmoid(beta (kl - r)))``.
    Rewards are ``beta * r``; a row is "accurate" when its reward's sign matches its label."""
    logratio = policy - ref
    desirable = desirable.to(torch.bool)
    losses = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (logratio - kl))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratio))),
    )
    return losses, kto_stats(beta * logratio.detach(), desirable, kl)


# The KTO paper (and TRL) advise weights with w_d * n_d / (w_u * n_u) in [1, 4/3].
KTO_RATIO = (1.0, 4 / 3)
MAX_KTO_WEIGHT = 100.0


def kto_weights(
    n_desirable: int, n_undesirable: int, desirable: float | None = None, undesirable: float | None = None
) -> tuple[float, float]:
    """The (desirable, undesirable) weights of a KTO run: the ones given; each one not given is
    balanced to the counts so that ``w_d n_d / (w_u n_u)`` lands in the paper's [1, 4/3]
    (feedback that is mostly thumbs down weights its few desirable rows up, and the reverse).
    With one label missing there is nothing to balance: 1.0."""
    w_d = 1.0 if desirable is None else desirable
    w_u = 1.0 if undesirable is None else undesirable
    if not (n_desirable and n_undesirable) or (desirable is not None and undesirable is not None):
        return w_d, w_u
    ratio = w_d * n_desirable / (w_u * n_undesirable)
    low, high = KTO_RATIO
    if ratio < low:
        if desirable is None:
            w_d = min(MAX_KTO_WEIGHT, w_u * n_undesirable * low / n_desirable)
        else:
            w_u = max(1 / MAX_KTO_WEIGHT, w_d * n_desirable / (n_undesirable * low))
    elif ratio > high:
        if undesirable is None:
            w_u = min(MAX_KTO_WEIGHT, w_d * n_desirable / (n_undesirable * high))
        else:
            w_d = max(1 / MAX_KTO_WEIGHT, w_u * n_undesirable * high / n_desirable)
    return w_d, w_u


def kto_stats(rewards: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor) -> dict[str, float]:
    """Accuracy (reward sign matches the label) and margin (mean desirable reward minus mean
    undesirable reward; a side with no rows counts as 0)."""
    good, bad = rewards[desirable], rewards[~desirable]
    correct = torch.where(desirable, rewards > 0, rewards < 0).float()
    chosen = float(good.mean()) if good.numel() else 0.0
    rejected = float(bad.mean()) if bad.numel() else 0.0
    return {
        "reward_margin": chosen - rejected,
        "reward_accuracy": float(correct.mean()) if correct.numel() else 0.0,
        "chosen_reward": chosen,
        "rejected_reward": rejected,
        "kl": float(kl),
    }


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
