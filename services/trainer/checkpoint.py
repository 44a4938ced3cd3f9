"""Checkpoints: everything a job needs to continue exactly where it stopped.

A checkpoint folder ``step-<N>/`` holds the trainable weights (the LoRA adapter, or
the whole model for a full fine-tune, plus a PPO value head) as safetensors, and
``state.pt`` with the optimizer, the scheduler, the step (which fixes the data
position: the batch schedule is a pure function of the seed) and the RNG states
of torch, Python and numpy. It is written into a temp folder, its files and the folder
fsynced, and renamed into place (the parent fsynced too), so neither a worker killed
mid-write nor a machine losing power leaves a half checkpoint under a ``step-<N>`` name.
A checkpoint that cannot be read all the same (a disk error, a file damaged later) is
skipped on resume for the one before it: ``keep`` checkpoints are kept for that.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from services.common.atomic import fsync_path

_STEP = re.compile(r"^step-(\d+)$")


class RngState(TypedDict):
    """The random generators' states a checkpoint keeps (``state.pt``'s ``rng``)."""

    torch: torch.Tensor
    python: tuple[Any, ...]  # random.getstate()
    numpy: tuple[Any, ...] | dict[str, Any]  # np.random.get_state(), legacy or dict form


def rng_state() -> RngState:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: RngState) -> None:
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
    for f in (tmp / "trainable.safetensors", tmp / "state.pt", tmp):
        fsync_path(f)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_path(root)  # the rename itself
    for _, old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    weights = load_file(str(path / "trainable.safetensors"))
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    return weights, state


Loaded = tuple[int, Path, dict[str, torch.Tensor], dict[str, Any]]
_STATE_KEYS = ("step", "optimizer", "scheduler", "rng", "extra")


def load_latest(root: Path, log: Callable[[str], object] = print) -> Loaded | None:
    """The newest checkpoint under ``root`` that reads whole: (step, folder, weights, state).
    One that does not (truncated, corrupt, missing a part) is logged and the one before it
    tried; None when there is none to resume from."""
    for step, path in reversed(list_checkpoints(root)):
        try:
            weights, state = load_checkpoint(path)
            missing = [k for k in _STATE_KEYS if k not in state]
            if missing:
                raise ValueError(f"state.pt lacks {missing}")
        # Whatever the damage (safetensors, pickle, zip or OS errors), the answer is the same:
        # this checkpoint cannot be resumed from, and the previous one may.
        except Exception as exc:
            log(f"checkpoint {path.name} is unreadable ({type(exc).__name__}: {exc}); trying the one before")
            continue
        return step, path, weights, state
    return None
