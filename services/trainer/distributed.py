"""Data-parallel training inside torchrun: one process per rank, DDP or FSDP2.

The worker (``launch.py``) starts ``torchrun ... -m services.trainer.distributed LAUNCH``;
each rank reads the pickled :class:`Launch` (the job's ``TrainConfig``, written by the
worker on shared storage), joins the process group (gloo on CPU, NCCL on GPUs) and runs
the same recipe loop as a single process (``recipes/base.run``) with ``cfg.dist`` set.

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

Rank 0 alone talks to the job store (progress, metrics, logs); the stop decision
(cancel, or the worker's lease lost) is taken by rank 0 and broadcast, so all ranks stop
before the same step.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from services.trainer.modeling import gather_logps, hidden_states
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


class PackForward(nn.Module):
    """The model's decoder and output head in one ``forward``: DDP and FSDP hook the
    wrapped module's forward, and the recipes call the decoder and the head separately
    (the head at label positions only), so the wrapper makes both one call."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        src: torch.Tensor,
        targets: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        startend_row_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = hidden_states(
            self.model,
            input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            startend_row_indices=startend_row_indices,
        )
        return gather_logps(self.model, h, src, targets)


def label_logps(
    model: Any,
    input_ids: torch.Tensor,
    src: torch.Tensor,
    targets: torch.Tensor,
    **masks: torch.Tensor | None,
) -> torch.Tensor:
    """Log-probs of ``targets`` at flat positions ``src`` (``masks``: ``PackForward``'s
    position_ids, attention_mask, startend_row_indices). ``model`` is a causal LM, or under
    torchrun the data-parallel wrapper (``DistContext.dp``), so the recipes' forwards are the
    same code in one process and on every rank; the inputs go to the model's device."""
    fwd = (
        model if isinstance(model, PackForward | nn.parallel.DistributedDataParallel) else PackForward(model)
    )
    dev = next(fwd.parameters()).device
    out: torch.Tensor = fwd(
        input_ids.to(dev),
        src.to(dev),
        targets.to(dev),
        **{k: None if v is None else v.to(dev) for k, v in masks.items()},
    )
    return out


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


class RankHooks:
    """The job's hooks seen from a rank: rank 0 reports, everyone agrees on stopping."""

    def __init__(self, ctx: DistContext, inner: Any) -> None:
        self.ctx = ctx
        self.inner = inner  # the job's hooks on rank 0, None elsewhere

    def should_stop(self) -> bool:
        from services.trainer.runner import LeaseLost

        verdict = "go"
        if self.inner is not None:
            try:
                verdict = "stop" if self.inner.should_stop() else "go"
            except LeaseLost:  # every rank must leave, not only rank 0
                verdict = "lost"
        verdict = self.ctx.agree(verdict)
        if verdict == "lost":
            raise LeaseLost("another worker holds the job now")
        return bool(verdict == "stop")

    def report(self, step: int, total: int, metrics: dict[str, float]) -> None:
        if self.inner is not None:
            self.inner.report(step, total, metrics)

    def log(self, message: str) -> None:
        if self.inner is not None:
            self.inner.log(message)

    def resumed(self, step: int) -> None:
        if self.inner is not None:
            self.inner.resumed(step)

    def evaluated(self, phase: str, metrics: dict[str, float]) -> None:
        if self.inner is not None:
            self.inner.evaluated(phase, metrics)


def _die_with_parent() -> None:
    """A rank outlives nothing: when its torchrun agent dies (the worker was killed), so does it."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before prctl
            os._exit(1)


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


def _job_hooks(launch: Launch) -> Any:
    import threading

    from services.common.config import CommonSettings, load_settings
    from services.common.redis_conn import sync_redis
    from services.trainer.runner import JobHooks, LeaseLost
    from services.trainer.store import TrainerStore

    common = load_settings(CommonSettings, check_unknown=False)
    store = TrainerStore(sync_redis(common.redis_url))
    owner = launch.owner

    class LeaseHooks(JobHooks):
        # The worker's heartbeat renews the lease; rank 0 only checks it is still the worker's.
        def should_stop(self) -> bool:
            holder = store.lease_owner(launch.job_id)
            if holder is not None and holder != owner:
                raise LeaseLost(launch.job_id)
            return super().should_stop()

    return LeaseHooks(store, launch.job_id, threading.Event())


def run_rank(launch: Launch) -> str:
    from services.trainer.recipes.base import run
    from services.trainer.runner import recipe_for

    ctx = init_rank(launch.resources.strategy)
    try:
        hooks = RankHooks(ctx, _job_hooks(launch) if ctx.is_main else None)
        pids = [None] * ctx.world
        dist.all_gather_object(pids, f"{socket.gethostname()}:{os.getpid()}")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        hooks.log(
            f"torchrun: {ctx.world} ranks ({launch.resources.strategy}, restart {restart}): "
            + ", ".join(f"{r}={p}" for r, p in enumerate(pids))
        )
        cfg = launch.cfg
        cfg.dist, cfg.device = ctx, ctx.device
        recipe = recipe_for(cfg.kind)(cfg, hooks=hooks)
        outcome = run(recipe, launch.checkpoints)
        if outcome == "succeeded":
            recipe.save_final(launch.artifact_tmp)
        if ctx.is_main:
            tmp = launch.outcome.with_suffix(".tmp")
            tmp.write_text(json.dumps({"outcome": outcome}))
            tmp.replace(launch.outcome)
        ctx.barrier()  # nobody exits (ending torchrun on its node) before rank 0 has written
        return outcome
    finally:
        dist.destroy_process_group()


def error_handler() -> Any:
    """torch's error handler, but writing the error file whole or not at all.

    torch's own opens the file (empty) and then writes the JSON; when a rank dies and another
    fails on the broken collective, torchrun can read that empty file in between and crash
    on the ``JSONDecodeError`` instead of restarting the ranks (seen in CI).
    """
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    from services.common.atomic import atomic_write

    class AtomicErrorHandler(ErrorHandler):
        def record_exception(self, e: BaseException) -> None:
            file = self._get_error_file_path()
            if not file:
                return
            data = {
                "message": {
                    "message": f"{type(e).__name__}: {e}",
                    "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))},
                }
            }
            atomic_write(Path(file), json.dumps(data).encode())

    return AtomicErrorHandler()


def main(argv: list[str] | None = None) -> NoReturn:
    from torch.distributed.elastic.multiprocessing.errors import record

    _die_with_parent()
    args = sys.argv[1:] if argv is None else argv
    with open(args[0], "rb") as f:
        launch: Launch = pickle.load(f)  # written by our own worker under the job's folder

    # record: a rank's exception lands in torchrun's error file and its summary
    record(run_rank, error_handler())(launch)
    # A finished rank skips interpreter teardown. gloo's threads can still hold work objects
    # whose tensors are freed while the interpreter is being torn down, which aborts the rank
    # ("terminate called without an active exception", SIGABRT) after it has done everything:
    # torchrun then fails a job that succeeded (seen once in CI). By now the weights and the
    # outcome file are written and closed, and the process group is destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
