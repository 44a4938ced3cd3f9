"""What every recipe shares: the config, model set-up, optimizer, and the step loop
with checkpoints, resume and cancellation.

A recipe is small: it builds its batch schedule in ``setup`` and does one optimizer
step in ``train_step``. The loop here owns the rest, so SFT, DPO, PPO and GRPO
checkpoint, resume and stop the same way.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from services.common.platforms import current_platform
from services.trainer import checkpoint as ckpt
from services.trainer.modeling import apply_lora, count_params, load_causal_lm, trainable_state
from services.trainer.protocol import Hyperparameters, LoraSpec

log = logging.getLogger("tandem.trainer.recipes")


@dataclass
class TrainConfig:
    kind: str  # sft | dpo | simpo | orpo | kto | ppo | grpo | embedder
    model_path: Path
    # the kind's records (data/formats.py); an embedder job's pairs (data/pairs.py)
    records: list[Any]
    eval_records: list[Any] | None = None
    hp: Hyperparameters = field(default_factory=lambda: Hyperparameters.model_validate({}))
    lora: LoraSpec | None = None
    packing: bool = True
    max_tokens_per_pack: int = 4096
    pad_to_multiple_of: int = 1
    reward: Any = None  # a RewardFn for ppo/grpo
    device: torch.device | None = None
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    work_dir: Path | None = None  # checkpoints and caches live here
    # a LoRA adapter the job's adapter starts from (a job whose base_model is the tenant's
    # own adapter fine-tune): its rank and targets are the new adapter's
    init_adapter: Path | None = None
    # inside torchrun: this rank's services.trainer.distributed.DistContext (None: one process)
    dist: Any = None
    # embedder jobs: the texts held-out queries are ranked against (id -> text; see data/pairs.py)
    corpus: dict[str, str] | None = None
    # embedder jobs with positives "chunks": document id -> the texts its collection indexes for it
    chunks: dict[str, list[str]] | None = None
    # embedder jobs: "titles_first" trains the title pairs, then the others (JobCreate.stages)
    stages: str = "together"

    @property
    def learning_rate(self) -> float:
        if self.hp.learning_rate is not None:
            return self.hp.learning_rate
        return 1e-4 if self.lora is not None else 1e-5


class Hooks(Protocol):
    def should_stop(self) -> bool: ...
    def report(self, step: int, total: int, metrics: dict[str, float]) -> None: ...
    def log(self, message: str) -> None: ...
    def resumed(self, step: int) -> None: ...
    def evaluated(self, phase: str, metrics: dict[str, float]) -> None: ...


class NullHooks:
    def __init__(self) -> None:
        self.history: list[dict[str, float]] = []
        self.evals: dict[str, dict[str, float]] = {}

    def evaluated(self, phase: str, metrics: dict[str, float]) -> None:
        self.evals[phase] = dict(metrics)

    def should_stop(self) -> bool:
        return False

    def report(self, step: int, total: int, metrics: dict[str, float]) -> None:
        self.history.append({"step": step, **metrics})

    def log(self, message: str) -> None:
        log.info(message)

    def resumed(self, step: int) -> None:
        self.history = [h for h in self.history if h["step"] <= step]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def schedule_factor(step: int, kind: str, warmup: int, total: int) -> float:
    """The learning rate's multiplier at ``step`` (from 0) of ``total``: linear warmup, then
    constant, linear or cosine decay."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if kind == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    return max(0.0, 1.0 - progress)


def make_scheduler(optimizer: torch.optim.Optimizer, kind: str, warmup: int, total: int) -> Any:
    return make_staged_scheduler(optimizer, kind, warmup, [0, total])


def make_staged_scheduler(optimizer: torch.optim.Optimizer, kind: str, warmup: int, bounds: list[int]) -> Any:
    """A schedule that starts again (warmup, then decay) at each stage: ``bounds`` are the
    stages' first steps (from 0) and, last, the total."""

    def factor(step: int) -> float:
        stage = max(i for i in range(len(bounds) - 1) if bounds[i] <= step) if step >= bounds[0] else 0
        return schedule_factor(step - bounds[stage], kind, warmup, bounds[stage + 1] - bounds[stage])

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Recipe:
    """Base of the recipes: loads the model (LoRA or full) and runs the loop."""

    total_steps: int = 0
    eval_before: dict[str, float]

    def __init__(self, cfg: TrainConfig, hooks: Hooks | None = None) -> None:
        self.cfg = cfg
        self.hp = cfg.hp
        self.hooks: Hooks = hooks or NullHooks()
        self.dist = cfg.dist
        self.device = cfg.device or current_platform().device()
        self.platform = current_platform()
        self.model: Any = None
        self.tokenizer: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.last_metrics: dict[str, float] = {}
        self.eval_before = {}
        self._refs: dict[str, torch.Tensor] = {}

    # ---- set-up
    def load_model(self, attn: str = "flashmask") -> None:
        from transformers import AutoTokenizer

        seed_everything(self.hp.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.cfg.model_path))
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model = load_causal_lm(self.cfg.model_path, device=self.device, attn=attn)
        if self.hp.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.cfg.lora is not None:
            lo = self.cfg.lora
            if self.cfg.init_adapter is not None:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, str(self.cfg.init_adapter), is_trainable=True)
                self.hooks.log(f"LoRA initialised from {self.cfg.init_adapter}")
            else:
                model = apply_lora(model, lo.r, lo.alpha, lo.dropout, lo.target_modules)
            if self.hp.gradient_checkpointing:
                model.enable_input_require_grads()
        model.train()
        self.model = model
        trainable, total = count_params(model)
        self.hooks.log(f"model {self.cfg.model_path.name}: {trainable:,} trainable of {total:,} parameters")

    @property
    def lm(self) -> Any:
        """What the recipes' forwards call: the model, or under torchrun once wrapped the
        data-parallel wrapper (``modeling.label_logps`` takes either)."""
        if self.dist is not None and self.dist.dp is not None:
            return self.dist.dp
        return self.model

    def trainable_modules(self) -> list[torch.nn.Module]:
        return [self.model]

    def params(self) -> list[torch.nn.Parameter]:
        seen: set[int] = set()
        out = []
        for mod in self.trainable_modules():
            for p in mod.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    @property
    def is_main(self) -> bool:
        """The process that writes checkpoints and final weights (rank 0, or the only one)."""
        return self.dist is None or self.dist.is_main

    def make_optimizer(self) -> None:
        if self.dist is not None:
            # before the optimizer: FSDP replaces the parameters with sharded ones
            self.dist.wrap(self.model)
        self.optimizer = torch.optim.AdamW(
            self.params(), lr=self.cfg.learning_rate, weight_decay=self.hp.weight_decay, foreach=False
        )
        self.scheduler = make_scheduler(
            self.optimizer, self.hp.lr_scheduler, self.hp.warmup_steps, max(self.total_steps, 1)
        )

    def step_schedule(self, build: Callable[..., list[Any]], lengths: list[int]) -> list[Any]:
        """The job's batch schedule over samples of ``lengths`` (``build`` is the recipe's
        schedule function, a pure function of the seed), and ``total_steps`` from it."""
        schedule = build(
            lengths,
            packing=self.cfg.packing,
            capacity=self.cfg.max_tokens_per_pack,
            seed=self.hp.seed,
            epochs=self.hp.n_epochs,
            per_step=self.hp.packs_per_step if self.cfg.packing else self.hp.batch_size,
        )
        self.total_steps = min(len(schedule), self.hp.max_steps or len(schedule))
        return schedule

    def setup(self) -> None:
        raise NotImplementedError

    def train_step(self, step: int) -> dict[str, float]:
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (``loss``, and ``accuracy``/``margin`` for preference jobs) on
        ``cfg.eval_records``; empty when there is none or the recipe has no loss to report."""
        return {}

    def reference(self, name: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Reference log-probs, computed once (adapter switched off for LoRA; for a full
        fine-tune the untouched model is the reference at that moment) and cached in
        ``work_dir/<name>.pt``, which a resumed job reuses."""
        if name in self._refs:  # also without a work_dir, computed only once
            return self._refs[name]
        cache = None if self.cfg.work_dir is None else self.cfg.work_dir / f"{name}.pt"
        if cache is not None and cache.is_file():
            self._refs[name] = torch.load(cache)
            return self._refs[name]
        ctx = self.model.disable_adapter() if self.cfg.lora is not None else nullcontext()
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad(), ctx:
            ref = compute()
        self.model.train(was_training)
        if cache is not None and self.is_main:  # under torchrun every rank computed the same
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(".tmp")
            torch.save(ref, tmp)
            tmp.replace(cache)
        self._refs[name] = ref
        return ref

    def run_eval(self) -> dict[str, float]:
        if not self.cfg.eval_records:
            return {}
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            out = self.evaluate()
        self.model.train(was_training)
        return out

    # ---- helpers for recipes
    def autocast(self) -> Any:
        if self.platform.is_accelerator and self.platform.default_dtype() != torch.float32:
            return torch.autocast(self.device.type, dtype=self.platform.default_dtype())
        return torch.autocast("cpu", enabled=False)

    def optimizer_step(self, *, advance_schedule: bool = True) -> float:
        assert self.optimizer is not None
        params = self.params()
        if self.hp.max_grad_norm > 0:
            total = torch.nn.utils.clip_grad_norm_(params, self.hp.max_grad_norm)
        else:
            total = torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
        # FSDP's norm is a DTensor (its shards' partial norms): the whole one is the same on every rank
        norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        self.optimizer.step()
        if advance_schedule:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def lr(self) -> float:
        assert self.optimizer is not None
        return float(self.optimizer.param_groups[0]["lr"])

    def finish_step(
        self, t0: float, loss: float, real: int, processed: int, extra: dict[str, float]
    ) -> dict[str, float]:
        """Clip, step the optimizer and report the step's metrics (``real``/``processed``
        tokens give the throughput and padding ratio since ``t0``); shared by the recipes."""
        lr = self.lr()
        grad_norm = self.optimizer_step()
        self.platform.synchronize()
        dt = time.perf_counter() - t0
        return {
            "loss": loss,
            "learning_rate": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": real / dt,
            "padding_ratio": 1 - real / max(processed, 1),
            **extra,
        }

    # ---- state
    def weights(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, mod in enumerate(self.trainable_modules()):
            for k, v in trainable_state(mod).items():
                # sharded (FSDP): gathered whole on every rank, in the same order on each
                out[f"{i}.{k}"] = v if self.dist is None else self.dist.full(v)
        return out

    def optimizer_state(self) -> dict[str, Any]:
        assert self.optimizer is not None
        return (
            self.optimizer.state_dict()
            if self.dist is None
            else self.dist.full_optimizer_state(self.optimizer)
        )

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        assert self.optimizer is not None
        if self.dist is None:
            self.optimizer.load_state_dict(state)
        else:
            self.dist.load_optimizer_state(self.optimizer, state)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        for i, mod in enumerate(self.trainable_modules()):
            prefix = f"{i}."
            sub = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
            named = dict(mod.named_parameters())
            missing = [n for n, p in named.items() if p.requires_grad and n not in sub]
            if missing:
                raise RuntimeError(f"checkpoint lacks {missing[:3]}")
            if self.dist is not None:  # whole tensors from the file, this rank's shard of each
                sub = {k: self.dist.like(v, named[k]) if k in named else v for k, v in sub.items()}
            mod.load_state_dict(sub, strict=False)

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def save_final(self, out: Path) -> None:
        """The model (full fine-tune) or the PEFT adapter, in Hugging Face format."""
        state = None
        if self.dist is not None and self.dist.strategy == "fsdp":
            # every rank takes part in gathering the shards; rank 0 writes them
            state = {k: self.dist.full(v) for k, v in self.model.state_dict().items()}
        if not self.is_main:
            return
        out.mkdir(parents=True, exist_ok=True)
        extra = {} if state is None else {"state_dict": state}
        self.model.save_pretrained(str(out), safe_serialization=True, **extra)
        self.tokenizer.save_pretrained(str(out))
        (out / "tandem_training.json").write_text(
            json.dumps(
                {
                    "type": self.cfg.kind,
                    "base_model": str(self.cfg.model_path),
                    "lora": self.cfg.lora.model_dump() if self.cfg.lora else None,
                    "hyperparameters": self.hp.model_dump(),
                    "steps": self.total_steps,
                    "final_metrics": self.last_metrics,
                },
                indent=2,
            )
        )


def run(recipe: Recipe, checkpoint_root: Path | None = None) -> str:
    """Set up, resume from the latest checkpoint if any, and train; returns
    ``"succeeded"`` or ``"cancelled"`` (a cancel is honoured before each step)."""
    cfg = recipe.cfg
    recipe.setup()
    start = 0
    if checkpoint_root is not None:
        loaded = ckpt.load_latest(checkpoint_root, recipe.hooks.log)
        if recipe.dist is not None:  # rank 0's view of the folder decides for all
            agreed = recipe.dist.agree(loaded[:2] if loaded else None)
            if agreed is None:
                loaded = None
            elif loaded is None or loaded[1] != agreed[1]:
                loaded = (*agreed, *ckpt.load_checkpoint(agreed[1]))
        if loaded is not None:
            step, path, weights, state = loaded
            recipe.load_weights(weights)
            assert recipe.optimizer is not None
            recipe.load_optimizer_state(state["optimizer"])
            recipe.scheduler.load_state_dict(state["scheduler"])
            extra = dict(state["extra"])
            recipe.eval_before = extra.pop("eval_before", {})
            recipe.load_extra_state(extra)
            ckpt.set_rng_state(state["rng"])
            start = step
            recipe.hooks.resumed(step)
            recipe.hooks.log(f"resumed from checkpoint step {step} ({path})")
    if start == 0:
        # Held-out metrics before the first update (a resumed job kept them in its checkpoint).
        recipe.eval_before = {f"eval_{k}_before": v for k, v in recipe.run_eval().items()}
        if recipe.eval_before:
            recipe.hooks.evaluated("before", recipe.eval_before)
    total = recipe.total_steps
    for step in range(start + 1, total + 1):
        if recipe.hooks.should_stop():
            recipe.hooks.log(f"cancelled before step {step}")
            return "cancelled"
        metrics = recipe.train_step(step)
        recipe.last_metrics = metrics
        recipe.hooks.report(step, total, metrics)
        if checkpoint_root is not None and step % cfg.checkpoint_every == 0 and step < total:
            weights, optimizer = recipe.weights(), recipe.optimizer_state()  # collective when sharded
            if recipe.is_main:
                ckpt.save_checkpoint(
                    checkpoint_root,
                    step,
                    weights=weights,
                    optimizer=optimizer,
                    scheduler=recipe.scheduler,
                    extra={**recipe.extra_state(), "eval_before": recipe.eval_before},
                    keep=cfg.keep_checkpoints,
                )
            recipe.hooks.log(f"checkpoint at step {step}")
    after = {f"eval_{k}_after": v for k, v in recipe.run_eval().items()}
    if after:
        recipe.hooks.evaluated("after", {**recipe.eval_before, **after})
    recipe.last_metrics = {**recipe.last_metrics, **recipe.eval_before, **after}
    return "succeeded"
