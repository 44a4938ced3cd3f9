"""Checkpoints: everything a job needs to continue exactly where it stopped.

A checkpoint folder ``step-<N>/`` holds the trainable weights (the LoRA adapter, or
the whole model for a full fine-tune, plus a PPO value head) as safetensors, and
``state.pt`` with the optimizer, the scheduler, the step (which fixes the data
position: the batch schedule is a pure function of the seed) and the RNG states
of torch, Python and numpy. It is written into a temp folder and renamed into
place, so a worker killed mid-write never leaves a half checkpoint behind.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

_STEP = re.compile(r"^step-(\d+)$")


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP.match(child.name)
        if m and (child / "state.pt").is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(
    root: Path,
    step: int,
    *,
    weights: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | dict[str, Any],
    scheduler: Any,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # Tied weights appear once in named_parameters(), so there are no shared tensors here.
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "trainable.safetensors"))
    torch.save(
        {
            "step": step,
            # a dict: the state already gathered whole from the ranks of a sharded job
            "optimizer": optimizer if isinstance(optimizer, dict) else optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
            "extra": extra or {},
        },
        tmp / "state.pt",
    )
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for _, old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    weights = load_file(str(path / "trainable.safetensors"))
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    return weights, state
