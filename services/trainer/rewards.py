"""Rewards for PPO/GRPO: Python functions registered by name, or a reward-model folder.

A reward function takes the dataset records (``data/formats.PromptRecord``: ``prompt`` messages
and an optional reference ``answer``) and the generated completions (text), and returns one
float per completion. Register your own with ``@register_reward("name")`` in a module
the worker imports; jobs name it in ``"reward": "name"``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from services.trainer.data.formats import PromptRecord

RewardFn = Callable[[Sequence[PromptRecord], Sequence[str]], list[float]]
_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        _REGISTRY[name] = fn
        return fn

    return deco


def reward_names() -> list[str]:
    return sorted(_REGISTRY)


def get_reward(name: str) -> RewardFn:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"no reward function named {name!r} (registered: {', '.join(reward_names())})"
        ) from None


_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def gsm8k_number(text: str) -> str | None:
    """The number after the last ``####``, normalised (no thousands commas, no trailing ``.0``)."""
    found = _FINAL.findall(text or "")
    if not found:
        return None
    value = found[-1].replace(",", "")
    if "." in value:
        value = value.rstrip("0").rstrip(".")
    return value.lstrip("+") or "0"


@register_reward("gsm8k_exact_match")
def gsm8k_exact_match(records: Sequence[PromptRecord], completions: Sequence[str]) -> list[float]:
    """1.0 when the completion's ``#### <number>`` equals the reference answer's, else 0.0."""
    out = []
    for rec, text in zip(records, completions, strict=True):
        ref = gsm8k_number(rec.answer or "")
        got = gsm8k_number(text)
        out.append(1.0 if ref is not None and got == ref else 0.0)
    return out


class RewardModel:
    """A sequence-classification model scoring the rendered conversation; the first logit is the reward."""

    def __init__(self, path: Path, device: torch.device | None = None) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = device or torch.device("cpu")
        self.model.to(self.device)

    @torch.no_grad()
    def __call__(self, records: Sequence[PromptRecord], completions: Sequence[str]) -> list[float]:
        scores = []
        for rec, text in zip(records, completions, strict=True):
            msgs = [*rec.prompt, {"role": "assistant", "content": text}]
            rendered = self.tokenizer.apply_chat_template(msgs, tokenize=False)
            enc = self.tokenizer(rendered, return_tensors="pt", truncation=True).to(self.device)
            scores.append(float(self.model(**enc).logits[0, 0]))
        return scores
