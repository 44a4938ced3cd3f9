"""One rank of a distributed job: the program torchrun starts on every rank.

``torchrun ... -m services.trainer.rank LAUNCH`` (see ``launch.py``): each rank reads the
pickled ``distributed.Launch``, joins the process group and runs the job type's recipe with
its ``DistContext`` (``distributed.py`` has how a step is split across the ranks).

Rank 0 alone talks to the job store (progress, metrics, logs); the stop decision
(cancel, or the worker's lease lost) is taken by rank 0 and broadcast, so all ranks stop
before the same step.
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist

from services.trainer.distributed import DistContext, Launch, init_rank
from services.trainer.hooks import JobHooks, LeaseLost


class RankHooks:
    """The job's hooks seen from a rank: rank 0 reports, everyone agrees on stopping."""

    def __init__(self, ctx: DistContext, inner: Any) -> None:
        self.ctx = ctx
        self.inner = inner  # the job's hooks on rank 0, None elsewhere

    def should_stop(self) -> bool:
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


def _job_hooks(launch: Launch) -> Any:
    import threading

    from services.common.config import CommonSettings, load_settings
    from services.common.redis_conn import sync_redis
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
