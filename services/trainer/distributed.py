"""Data-parallel training inside torchrun: one process per rank, DDP or FSDP2.

The worker (``launch.py``) starts ``torchrun ... -m services.trainer.rank LAUNCH``;
each rank (``rank.py``) reads the pickled :class:`Launch` (the job's ``TrainConfig``,
written by the worker on shared storage), joins the process group (gloo on CPU, NCCL on
GPUs) and runs the same recipe loop as a single process (``recipes/base.run``) with
``cfg.dist`` set to its :class:`DistContext`.

How a step is split: the step's micro-batches (packs, or the samples of an unpacked
batch) are dealt round-robin to the ranks, each rank packs and runs only its own, and
every rank runs the same number of forward/backward passes (a rank short of data runs a
one-token pass whose loss is multiplied by zero), because DDP's and FSDP's collectives
need every rank in every call. Each rank's loss is the step's token-mean numerator over
*its* tokens divided by the step's total label tokens, times the world size, so the
average that DDP and FSDP take of the gradients is their sum: the gradient of the
single-process step on the same global batch.

Checkpoints stay in the single-process format (a full state dict gathered on every rank
and written by rank 0: trainable weights and the optimizer state with full tensors), so
a job checkpointed by N ranks resumes on M, and a single-process checkpoint on either.
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from services.trainer.modeling import PackForward
from services.trainer.protocol import ResourcesSpec

log = logging.getLogger("tandem.trainer.distributed")

Strategy = Literal["ddp", "fsdp"]


@dataclass
class Launch:
    """What the worker hands to every rank (pickled under the job's folder)."""

    job_id: str
    owner: str  # the worker's lease owner: rank 0 stops when another worker holds the job
    cfg: Any  # TrainConfig (cfg.dist is None here; each rank sets its own)
    resources: ResourcesSpec
    checkpoints: Path
    artifact_tmp: Path  # rank 0 writes the final weights here; the worker renames them
    outcome: Path  # rank 0 writes {"outcome": ...} here once done


class DistContext:
    """This rank's place in the job and the collectives the recipes need."""

    def __init__(self, strategy: Strategy, device: torch.device) -> None:
        self.strategy = strategy
        self.device = device
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.dp: Any = None  # the wrapped PackForward (DDP) or the sharded one (FSDP)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- data
    def share(self, items: list[Any]) -> list[Any]:
        """This rank's items (round-robin), padded with None so every rank has as many."""
        mine = items[self.rank :: self.world]
        rounds = -(-len(items) // self.world)
        return mine + [None] * (max(rounds, 1) - len(mine))

    # ---- collectives
    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def sum(self, *values: float) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return [float(v) for v in t.tolist()]

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks (each filled its own rows of it), on the CPU."""
        out = t.to(self.device, torch.float64)
        dist.all_reduce(out)
        return out.to(t.dtype).cpu()

    def sum_stats(self, stats: dict[str, float]) -> dict[str, float]:
        """Per-key sums of the ranks' metrics (a rank with filler passes only has none)."""
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, stats)
        keys = sorted({k for d in every for k in d})
        return {k: sum(float(d.get(k, 0.0)) for d in every) for k in keys}

    def filler(self, pad_id: int) -> torch.Tensor:
        """A one-token pass through the wrapper, for a rank short of data (every rank makes
        as many forward calls: DDP's and FSDP's collectives need them all); the caller
        multiplies it by zero."""
        ids = torch.tensor([[pad_id]], device=self.device)
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        out: torch.Tensor = self.dp(ids, zero, ids.reshape(-1), position_ids=zero.reshape(1, 1))
        return out

    def barrier(self) -> None:
        dist.barrier()

    # ---- model
    def wrap(self, model: nn.Module) -> Any:
        """DDP around the decoder+head, or FSDP2 over each decoder layer and the whole."""
        root = PackForward(model)
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.dp = DistributedDataParallel(
                root,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                # no buffer to keep in step (rotary frequencies are computed), and skipping the
                # broadcast keeps no-grad forwards (evaluation) free of collectives
                forward_sync_buffers=False,
            )
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            from services.trainer.modeling import base_lm

            mesh = init_device_mesh(self.device.type, (self.world,))
            for layer in base_lm(model).get_decoder().layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(root, mesh=mesh)
            self.dp = root
        return self.dp

    def sync_grads(self, last: bool) -> AbstractContextManager[Any]:
        """Gradients are reduced on the step's last micro-batch only (accumulated before)."""
        if self.strategy == "ddp":
            return nullcontext() if last else self.dp.no_sync()
        self.dp.set_requires_gradient_sync(last)
        return nullcontext()

    @staticmethod
    def full(t: torch.Tensor) -> torch.Tensor:
        """A whole tensor on the CPU from a (possibly sharded) one; collective for DTensors."""
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            t = t.full_tensor()
        return t.detach().cpu()

    @staticmethod
    def like(full: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        """``full`` laid out like ``ref`` (this rank's shard when ``ref`` is a DTensor). Every
        rank holds the whole tensor (read from the checkpoint), so nothing is sent."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        if isinstance(ref, DTensor):
            return distribute_tensor(
                full.to(ref.device, ref.dtype), ref.device_mesh, ref.placements, src_data_rank=None
            )
        return full

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        sd = optimizer.state_dict()
        state = {
            k: {
                name: self.full(v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                for name, v in s.items()
            }
            for k, s in sorted(sd["state"].items())
        }
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state = {
            k: {
                name: self.like(v, params[int(k)]) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                for name, v in s.items()
            }
            for k, s in sd["state"].items()
        }
        optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def init_rank(strategy: Strategy) -> DistContext:
    from services.common.platforms import current_platform

    platform = current_platform()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if platform.device_type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None)
    return DistContext(strategy, device)
