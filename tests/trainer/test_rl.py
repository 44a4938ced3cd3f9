"""GRPO and PPO raise the mean reward of a toy verifiable task.

The tiny random model is first taught by SFT to answer with random runs of the words
"yes" and "no" (about half each); the verifiable reward is the fraction of "yes"
words. A short RL run must then clearly raise the mean reward. Rollouts go through
the inference engine (``TorchEngine.from_model``). Marked e2e: on two shared CPU cores
the warm start and the two runs take a few minutes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from services.trainer.data.formats import PromptRecord, Record, parse_dataset
from services.trainer.protocol import Hyperparameters
from services.trainer.recipes.base import NullHooks, TrainConfig, run
from services.trainer.recipes.rl import GRPORecipe, PPORecipe
from services.trainer.recipes.sft import SFTRecipe
from services.trainer.rewards import get_reward, register_reward
from tests.trainer.conftest import jsonl

pytestmark = pytest.mark.e2e


@register_reward("toy_yes_fraction")
def yes_fraction(records: Sequence[PromptRecord], completions: Sequence[str]) -> list[float]:
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(w == "yes" for w in words) / max(len(words), 1))
    return out


def records() -> list[Record]:
    rng = random.Random(0)
    rows = [
        {"prompt": f"Pick {i}", "completion": " ".join(rng.choice(["yes", "no"]) for _ in range(6))}
        for i in range(64)
    ]
    return parse_dataset(jsonl(rows)).records


@pytest.fixture(scope="module")
def yes_no_model(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = TrainConfig(
        kind="sft",
        model_path=tiny_model_path,
        records=records(),
        hp=Hyperparameters(learning_rate=1e-2, n_epochs=20, max_steps=30, seed=0, lr_scheduler="constant"),
        max_tokens_per_pack=512,
        pad_to_multiple_of=16,
    )
    recipe = SFTRecipe(cfg)
    assert run(recipe) == "succeeded"
    out = tmp_path_factory.mktemp("yes-no")
    recipe.save_final(out)
    return out


def rl_run(recipe_cls: type, model: Path, **hp: Any) -> list[float]:
    cfg = TrainConfig(
        kind=recipe_cls.algo,
        model_path=model,
        records=records(),
        hp=Hyperparameters(
            **{
                "learning_rate": 1e-3,
                "max_new_tokens": 8,
                "seed": 0,
                "lr_scheduler": "constant",
                "n_epochs": 8,
                **hp,
            }
        ),
        max_tokens_per_pack=512,
        reward=get_reward("toy_yes_fraction"),
    )
    hooks = NullHooks()
    assert run(recipe_cls(cfg, hooks=hooks)) == "succeeded"
    return [h["reward"] for h in hooks.history]


def test_grpo_raises_mean_reward(yes_no_model: Path) -> None:
    rewards = rl_run(GRPORecipe, yes_no_model, max_steps=10, prompts_per_step=4, group_size=8, kl_coef=0.01)
    print(f"\nGRPO mean reward per step: {[round(r, 2) for r in rewards]}")
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > first + 0.15, rewards


def test_ppo_raises_mean_reward(yes_no_model: Path) -> None:
    rewards = rl_run(PPORecipe, yes_no_model, max_steps=10, prompts_per_step=32, kl_coef=0.01)
    print(f"\nPPO mean reward per step: {[round(r, 2) for r in rewards]}")
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > first + 0.15, rewards


def test_grpo_rollouts_are_reproducible(yes_no_model: Path) -> None:
    """Rollouts are seeded from the run's seed and the step: the same run twice samples the same
    completions (so the same rewards), and another seed samples others."""
    hp = {"max_steps": 2, "prompts_per_step": 4, "group_size": 8, "kl_coef": 0.01}
    first = rl_run(GRPORecipe, yes_no_model, **hp)
    assert rl_run(GRPORecipe, yes_no_model, **hp) == first
    assert rl_run(GRPORecipe, yes_no_model, **{**hp, "seed": 1}) != first
