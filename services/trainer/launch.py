"""Launching a distributed job from a Celery worker with ``torchrun``.

The worker that runs the job (the *lead*, holding its lease and heartbeat) writes the
job's ``TrainConfig`` next to its checkpoints, asks the job's queue for ``nodes - 1``
more machines (``tandem.trainer.join_job`` tasks) and starts its own ``torchrun``; all of
them meet at the lead's c10d rendezvous (``--rdzv-backend c10d``, the store hosted by the
lead). A rank that dies (``kill -9``, an OOM) makes torchrun stop the others and restart
them all (``TANDEM_TRAINER_DIST_MAX_RESTARTS``); they resume from the last checkpoint.
A worker killed itself takes its torchrun and ranks with it (parent-death signals), so the
job's expired lease is recovered by another worker as for a single-process job.

Shared storage is required across machines: ``$TANDEM_HOME`` (datasets, checkpoints, the
launch file and the final weights) must be the same folder on every node.
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from services.trainer.hooks import LeaseLost
from services.trainer.protocol import ResourcesSpec

ROOT = Path(__file__).resolve().parents[2]


class LaunchError(RuntimeError):
    pass


def local_devices() -> tuple[int, str]:
    """How many ranks this machine can run, and what they count: GPUs (or other
    accelerators) where there are some, else CPU cores (the ones this process may use)."""
    from services.common.platforms import current_platform

    platform = current_platform()
    if platform.is_accelerator:
        return platform.device_count(), f"{platform.device_type} devices"
    return len(os.sched_getaffinity(0)) if hasattr(
        os, "sched_getaffinity"
    ) else os.cpu_count() or 1, "CPU cores"


def check_devices(resources: ResourcesSpec) -> None:
    have, what = local_devices()
    if resources.procs_per_node > have:
        raise LaunchError(
            f"resources.procs_per_node {resources.procs_per_node} is more than the {have} {what} of worker "
            f"{socket.gethostname()}; ask for at most {have} (one process per device)"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def torchrun_argv(
    resources: ResourcesSpec, endpoint: str, rdzv_id: str, launch_file: Path, *, host: bool, settings: Any
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",  # the torchrun command, from this interpreter's torch
        "--nnodes",
        str(resources.nodes),
        "--nproc-per-node",
        str(resources.procs_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        f"is_host={int(host)},join_timeout={int(settings.rdzv_timeout_s)}",
        "--max-restarts",
        str(settings.dist_max_restarts),
        "--monitor-interval",
        "0.5",
        "-m",
        "services.trainer.rank",
        str(launch_file),
    ]


def _env(resources: ResourcesSpec) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    # Each round of ranks (the first, and each restart) gets a store of its own on rank 0: ranks
    # sharing the rendezvous store across restarts read the previous round's addresses and fail
    # to connect (pytorch/pytorch#135712: gloo's and NCCL's init after a torchrun restart)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if "OMP_NUM_THREADS" not in env:  # torchrun would set 1; the machine's cores shared out is faster on CPU
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // resources.procs_per_node))
    return env


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _tail(path: Path, n: int = 4000) -> str:
    try:
        data = path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""
    lines = [ln for ln in data.splitlines() if ln.strip()]
    return "\n".join(lines[-15:])


def run_torchrun(argv: list[str], env: dict[str, str], log_file: Path, stop: threading.Event | None) -> int:
    """Run torchrun to the end (its return code); killed with its whole group if ``stop`` is set."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("ab") as log:
        proc = subprocess.Popen(
            argv,
            env=env,
            cwd=str(ROOT),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own group: stopping it reaches every rank
            preexec_fn=_die_with_parent,
        )
        while True:
            try:
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                if stop is not None and stop.is_set():
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return -signal.SIGKILL


def run_distributed(
    job_id: str,
    cfg: Any,
    resources: ResourcesSpec,
    *,
    work: Path,
    artifact_tmp: Path,
    owner: str,
    attempt: int,
    settings: Any,
    lost: threading.Event,
    join: Any = None,
) -> str:
    """Train ``cfg`` on ``resources`` with torchrun; ``"succeeded"`` (final weights in
    ``artifact_tmp``) or ``"cancelled"``. ``join(job_id, endpoint, rdzv_id)`` asks another
    machine to join (multi-node only)."""
    from services.trainer.distributed import Launch

    check_devices(resources)
    work.mkdir(parents=True, exist_ok=True)
    launch_file = work / "launch.pkl"
    outcome_file = work / "outcome.json"
    outcome_file.unlink(missing_ok=True)
    launch = Launch(job_id, owner, cfg, resources, work / "checkpoints", artifact_tmp, outcome_file)
    tmp = launch_file.with_suffix(".tmp")
    with tmp.open("wb") as f:
        pickle.dump(launch, f)
    tmp.replace(launch_file)
    port = free_port()
    if resources.nodes > 1:
        endpoint = f"{settings.rdzv_host or socket.gethostname()}:{port}"
    else:
        endpoint = f"127.0.0.1:{port}"
    rdzv_id = f"{job_id}-{attempt}"
    if resources.nodes > 1:
        if join is None:
            raise LaunchError("resources.nodes > 1 needs other workers to join, and none can be asked here")
        for _ in range(resources.nodes - 1):
            join(job_id, endpoint, rdzv_id)
    log_file = work / "torchrun.log"
    argv = torchrun_argv(resources, endpoint, rdzv_id, launch_file, host=True, settings=settings)
    rc = run_torchrun(argv, _env(resources), log_file, lost)
    if lost.is_set():
        raise LeaseLost(job_id)
    if rc != 0:
        raise LaunchError(
            f"torchrun exited with {rc} (after up to {settings.dist_max_restarts} restarts):\n{_tail(log_file)}"
        )
    try:
        return str(json.loads(outcome_file.read_text())["outcome"])
    except (OSError, ValueError, KeyError):
        raise LaunchError(f"torchrun ended without an outcome from rank 0:\n{_tail(log_file)}") from None


def join_distributed(job_id: str, endpoint: str, rdzv_id: str, *, work: Path, settings: Any) -> int:
    """Another machine's part of a multi-node job: its own torchrun at the lead's rendezvous."""
    from services.trainer.distributed import Launch

    with (work / "launch.pkl").open("rb") as f:
        launch: Launch = pickle.load(f)
    resources = launch.resources
    check_devices(resources)
    argv = torchrun_argv(resources, endpoint, rdzv_id, work / "launch.pkl", host=False, settings=settings)
    return run_torchrun(argv, _env(resources), work / f"torchrun-{socket.gethostname()}.log", None)
