"""One step's loss and gradients (SFT, DPO and kin, KTO), in one process or (under torchrun) on every rank.

``python tests/trainer/dist_probe.py OUT MODEL DATA packed|padded ddp|fsdp lora|full [STEPS CKPT|- KIND]`` writes
rank 0's view to OUT (torch.save): the loss of each step and the whole gradients
(gathered from the shards under FSDP) of the first one. Run by tests/trainer/test_distributed.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from services.trainer.jobspec import KIND_OF, load_records
from services.trainer.protocol import Hyperparameters, LoraSpec
from services.trainer.recipes.base import Recipe, TrainConfig, run
from services.trainer.runner import recipe_for


class Probe(Recipe):
    """Keeps the whole gradients of the first step (mixed in before the job type's recipe)."""

    grads: dict[str, torch.Tensor] | None = None

    def optimizer_step(self, *, advance_schedule: bool = True) -> float:
        if self.grads is None:
            self.grads = {}
            for name, p in self.model.named_parameters():
                if p.requires_grad:
                    g = p.grad
                    self.grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g.detach().clone()
        return super().optimizer_step(advance_schedule=advance_schedule)


def probe(
    out: Path,
    model: Path,
    data: Path,
    packing: str,
    strategy: str,
    mode: str,
    steps: int,
    ckpt: Path | None,
    kind: str = "sft",
) -> None:
    records = load_records(data, KIND_OF[kind])  # rows as the worker gets them (messages)
    hp = Hyperparameters.model_validate(
        {"packs_per_step": 3, "batch_size": 5, "max_steps": steps, "learning_rate": 1e-2, "seed": 3}
    )
    ctx = None
    if "WORLD_SIZE" in os.environ:  # under torchrun
        from services.trainer.distributed import init_rank

        ctx = init_rank(strategy)  # type: ignore[arg-type]
    cfg = TrainConfig(
        kind=kind,
        model_path=model,
        records=records,
        hp=hp,
        lora=LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj"]) if mode == "lora" else None,
        packing=packing == "packed",
        max_tokens_per_pack=128,
        pad_to_multiple_of=64,
        checkpoint_every=2,
        keep_checkpoints=10,
        dist=ctx,
    )
    recipe = type("KindProbe", (Probe, recipe_for(kind)), {})(cfg)
    run(recipe, ckpt)
    hist: list[dict[str, Any]] = recipe.hooks.history  # type: ignore[attr-defined]
    weights = recipe.weights()  # every rank: gathering FSDP shards is collective
    if ctx is None or ctx.is_main:
        torch.save({"history": hist, "grads": recipe.grads, "weights": weights}, out)
    if ctx is not None:
        import torch.distributed as dist

        dist.destroy_process_group()


def main() -> None:
    out, model, data, packing, strategy, mode = sys.argv[1:7]
    steps = int(sys.argv[7]) if len(sys.argv) > 7 else 1
    ckpt = Path(sys.argv[8]) if len(sys.argv) > 8 and sys.argv[8] != "-" else None
    kind = sys.argv[9] if len(sys.argv) > 9 else "sft"
    probe(Path(out), Path(model), Path(data), packing, strategy, mode, steps, ckpt, kind)
    # As the trainer's ranks do (services/trainer/rank.py): a finished rank skips interpreter
    # teardown, where gloo's threads can abort it after its work is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
