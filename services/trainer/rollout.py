"""Rollouts for PPO/GRPO through the inference engine, in process.

The policy being trained is wrapped by ``TorchEngine.from_model`` once; since the
engine reads the live module, each call samples from the current weights (the
trainer updates them between rollouts). The engine runs its continuous-batching
scheduler with a KV cache, not ``model.generate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    finish_reason: str


class EngineRollouts:
    def __init__(self, model: Any, tokenizer: Any, device: torch.device, max_batch_size: int = 64) -> None:
        from services.inference.engine.torch_engine import TorchEngine

        self.tokenizer = tokenizer
        self.model = model
        self.engine = TorchEngine.from_model(model, tokenizer, device=device, max_batch_size=max_batch_size)

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        n: int = 1,
    ) -> list[Rollout]:
        """``n`` completions per prompt, prompt-major (the engine seeds sample j with ``seed + j``,
        so the members of a GRPO group differ while the run stays reproducible)."""
        from services.inference.engine import SamplingParams

        params = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_new_tokens,
            seed=seed,
            stop_token_ids=[int(self.tokenizer.eos_token_id)],
            detokenize=False,
            n=n,
        )
        was_training = self.model.training
        self.model.eval()
        try:
            outs = self.engine.generate_batch(prompts, params)
        finally:
            self.model.train(was_training)
        rollouts = []
        for out in outs:
            ids = list(out.token_ids)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            rollouts.append(Rollout(list(out.prompt_token_ids), ids, text, str(out.finish_reason)))
        return rollouts
