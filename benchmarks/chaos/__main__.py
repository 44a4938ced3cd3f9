"""Crash safety by repetition: kill -9 a part of the running stack at a random moment, let its
supervisor restart it, and check that nothing acknowledged was lost, duplicated or left stuck.

    python -m benchmarks.chaos --trials 100                 # every target, 100 kills each
    python -m benchmarks.chaos --trials 5 --targets retrieval,inference
    python -m benchmarks.chaos --trials 50 --out trials.jsonl   # appends each trial as it ends
    python -m benchmarks.chaos --tally trials.jsonl more.jsonl   # the table of runs so far

The stack is `tandem up` in a temporary home (benchmarks/stack.py); every component runs under
its supervisor (services/cli/supervise.py), which is what brings a killed one back. Targets:

- ``retrieval``: the retrieval service while a client adds documents one by one. Every
  document acknowledged (2xx) must be found by a search for its unique word exactly once.
- ``worker-io``: the ingestion worker during a queued ingestion job. The job must end
  ``succeeded`` and its documents be found exactly once.
- ``worker-cpu``: the training worker mid-job. The job must end ``succeeded`` with the step count
  of an uninterrupted run.
- ``agent``: the agent mid-answer of a remembered chat turn. The user's message must be in the
  conversation afterwards.
- ``inference``: the inference service mid-stream. It must answer the next request.
- ``redis``: Redis itself while documents are added. Acknowledged documents must be found,
  and every service must answer with the same key afterwards.
- ``supervisor``: the supervisor of a random component (``services.cli.supervise``, the pid in
  ``run/NAME.pid``) while documents are added. Its component must die with it (no orphan
  process, within 10 s), ``tandem up`` must start it again (the trial's recovery time is that
  ``tandem up``'s), acknowledged documents must be found, and after ``tandem down`` no process
  of the stack and none of its ports may be left; the stack is then started afresh for the
  next trial (so a trial takes a whole start of the stack: about 2 minutes on 2 cores).

    python -m benchmarks.chaos --targets supervisor --trials 100 --out supervisor.jsonl

A trial whose check fails counts as lost, duplicated or stuck (not done within the wait).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks.stack import REPO, SERVICES, TANDEM, Stack, embedded_stack
from services.cli.stack import pid_alive, port_free, read_pid
from services.cli.supervise import read_state
from tests.helpers.stack import home_processes

TARGETS = ("retrieval", "worker-io", "worker-cpu", "agent", "inference", "redis", "supervisor")
# Trainer recovery as the trainer's e2e tests set it: a dead worker's job is requeued within
# seconds rather than the default minute, so trials do not wait out production timeouts.
FAST_RECOVERY = {
    "TANDEM_TRAINER_HEARTBEAT_INTERVAL_S": "0.5",
    "TANDEM_TRAINER_STALE_AFTER_S": "5",
    "TANDEM_TRAINER_RECOVERY_INTERVAL_S": "1",
    # Kills come every few seconds here, so the supervisor's backoff (doubling to 30 s while a
    # component keeps dying) would measure the wait, not the recovery: cap it at 2 s.
    "TANDEM_SUPERVISE_BACKOFF_MAX_S": "2",
    # Bulk reads of every acknowledged document are the harness's, not a tenant's abuse.
    "TANDEM_RETRIEVAL_TENANT_REQUESTS_PER_MINUTE": "0",
    "TANDEM_AGENT_TENANT_REQUESTS_PER_MINUTE": "0",
    "TANDEM_TRAINER_TENANT_REQUESTS_PER_MINUTE": "0",
}
COLLECTION = "chaos"


@dataclass
class Trial:
    target: str
    acknowledged: int = 0
    lost: int = 0
    duplicated: int = 0
    stuck: int = 0
    recovery_s: float | None = None
    note: str = ""
    victim: str = ""  # supervisor target: whose supervisor was killed
    orphans: int = 0  # processes of the stack left running without their supervisor
    ports_left: int = 0  # ports of the stack still listening after `tandem down`


@dataclass
class Report:
    trials: list[Trial] = field(default_factory=list)


class Chaos:
    def __init__(self, stack: Stack, rng: random.Random, wait_s: float, train_model: str = "served") -> None:
        self.stack = stack
        self.train_model = train_model
        self.rng = rng
        self.wait_s = wait_s
        self.http = httpx.Client(headers={"Authorization": f"Bearer {stack.key}"}, timeout=120)
        self.n = 0

    # -- the kill and the wait ---------------------------------------------------------------
    def kill(self, component: str) -> int:
        state = read_state(self.stack.home / "run" / f"{component}.state.json")
        if state is None or state.pid is None:
            raise RuntimeError(f"{component} has no running process to kill")
        os.kill(state.pid, signal.SIGKILL)
        return state.pid

    def wait_back(self, component: str, old_pid: int) -> float | None:
        """Seconds until ``component`` runs again (a new pid) and the stack is ready; None if not
        within the wait."""
        start = time.monotonic()
        state_file = self.stack.home / "run" / f"{component}.state.json"
        while time.monotonic() - start < self.wait_s:
            state = read_state(state_file)
            if state and state.pid and state.pid != old_pid and self.ready():
                return time.monotonic() - start
            time.sleep(0.25)
        return None

    def ready(self) -> bool:
        try:
            return all(
                httpx.get(f"{self.stack.url(s)}/readyz", timeout=5).status_code == 200 for s in SERVICES
            )
        except httpx.HTTPError:
            return False

    def until(self, what: Callable[[], object], timeout: float) -> object:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got = what()
            except httpx.HTTPError:
                got = None
            if got:
                return got
            time.sleep(0.5)
        return None

    # -- documents ---------------------------------------------------------------------------
    def ensure_collection(self) -> None:
        r = self.http.post(f"{self.stack.url('retrieval')}/v1/collections", json={"name": COLLECTION})
        if r.status_code not in (200, 201, 409):
            raise RuntimeError(f"creating the collection: {r.status_code} {r.text}")

    def doc(self, tag: str) -> dict[str, str]:
        # one unique word per document, found by the sparse side of a search
        return {"id": tag, "text": f"Chaos record {tag} holds the word zq{tag.replace('-', 'x')} once."}

    def found(self, doc_id: str) -> int:
        r = self.http.post(
            f"{self.stack.url('retrieval')}/v1/collections/{COLLECTION}/search",
            json={"query": f"zq{doc_id.replace('-', 'x')}", "mode": "sparse", "top_k": 10},
        )
        r.raise_for_status()
        return sum(1 for hit in r.json()["results"] if hit["document_id"] == doc_id)

    def check_documents(self, trial: Trial, ids: list[str]) -> None:
        trial.acknowledged = len(ids)
        for doc_id in ids:
            n = self.found(doc_id)
            trial.lost += n == 0
            trial.duplicated += n > 1

    def write_while_killing(self, trial: Trial, component: str) -> None:
        """Add documents one by one; kill ``component`` at a random moment; check every
        acknowledged one."""

        def kill_and_wait() -> bool:
            old = self.kill(component)
            trial.recovery_s = self.wait_back(component, old)
            if trial.recovery_s is None:
                trial.stuck, trial.note = 1, f"{component} not back within {self.wait_s:.0f}s"
                return False
            return True

        self.write_during(trial, kill_and_wait)

    def write_during(self, trial: Trial, harm: Callable[[], bool]) -> None:
        """Add documents one by one while ``harm`` runs (after a random moment); when it says
        the stack is back, check every acknowledged document."""
        self.ensure_collection()
        acked: list[str] = []
        stop = threading.Event()

        def writer() -> None:
            i = 0
            while not stop.is_set():
                tag = f"t{self.n}-{i}"
                i += 1
                try:
                    r = self.http.post(
                        f"{self.stack.url('retrieval')}/v1/collections/{COLLECTION}/documents",
                        json={"documents": [self.doc(tag)]},
                        timeout=30,
                    )
                except httpx.HTTPError:
                    continue  # not acknowledged: the client would retry; nothing is owed
                if r.status_code in (200, 201):
                    acked.append(tag)

        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        time.sleep(self.rng.uniform(0.3, 2.0))
        back = harm()
        stop.set()
        thread.join(60)
        if back:
            self.check_documents(trial, acked)

    # -- targets -----------------------------------------------------------------------------
    def retrieval(self, trial: Trial) -> None:
        self.write_while_killing(trial, "retrieval")

    def redis(self, trial: Trial) -> None:
        self.write_while_killing(trial, "redis")
        if not trial.stuck:
            for svc in SERVICES:
                if self.http.get(f"{self.stack.url(svc)}/v1/whoami").status_code != 200:
                    trial.lost += 1
                    trial.note += f" {svc} refused the key after the restart;"

    def worker_io(self, trial: Trial) -> None:
        self.ensure_collection()
        ids = [f"t{self.n}-j{i}" for i in range(80)]
        r = self.http.post(
            f"{self.stack.url('retrieval')}/v1/collections/{COLLECTION}/documents",
            json={"documents": [self.doc(i) for i in ids]},
        )
        r.raise_for_status()
        job_id = r.json().get("job_id")
        time.sleep(self.rng.uniform(0.1, 2.0))
        old = self.kill("worker-io")
        trial.recovery_s = self.wait_back("worker-io", old)
        if job_id is None:  # ingested at once: acknowledged documents
            self.check_documents(trial, ids)
            return

        def final() -> dict[str, object] | None:
            job = self.http.get(f"{self.stack.url('retrieval')}/v1/jobs/{job_id}").json()
            state = job.get("status", job.get("state"))
            return job if state in ("succeeded", "failed", "cancelled") else None

        job = self.until(final, self.wait_s)
        if not isinstance(job, dict):
            trial.stuck, trial.note = 1, f"ingestion job {job_id} not finished within {self.wait_s:.0f}s"
            return
        if job.get("status", job.get("state")) != "succeeded":
            trial.lost, trial.note = len(ids), f"ingestion job failed: {job.get('error')}"
            return
        self.check_documents(trial, ids)

    def worker_cpu(self, trial: Trial) -> None:
        trainer = self.stack.url("trainer")
        if not hasattr(self, "_dataset"):
            rows = [
                {
                    "messages": [
                        {"role": "user", "content": f"Count to {n}."},
                        {"role": "assistant", "content": " ".join(map(str, range(1, n + 1)))},
                    ]
                }
                for n in range(2, 18)
            ]
            data = "\n".join(json.dumps(r) for r in rows).encode()
            self._dataset = self.http.post(
                f"{trainer}/v1/files", files={"file": ("chaos.jsonl", data)}
            ).json()["id"]
            if self.train_model == "tiny":
                from tests.helpers.models import make_tiny_llama

                self._model = str(make_tiny_llama(self.stack.home / "models" / "chaos-tiny"))
            else:
                self._model = self.http.get(f"{self.stack.url('inference')}/v1/models").json()["data"][0][
                    "id"
                ]
        # a tiny model's step takes milliseconds: more steps, and the kill waits for a random one
        steps = 40 if self.train_model == "tiny" else 8
        body = {
            "type": "sft",
            "base_model": self._model,
            "dataset": self._dataset,
            "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            "max_tokens_per_pack": 256,
            "hyperparameters": {"n_epochs": 40, "max_steps": steps, "checkpoint_every": 2, "seed": 7},
        }
        r = self.http.post(f"{trainer}/v1/jobs", json=body)
        r.raise_for_status()
        job_id = r.json()["id"]

        def job() -> dict[str, object]:
            return dict(self.http.get(f"{trainer}/v1/jobs/{job_id}").json())

        if not self.until(lambda: job()["status"] == "running", self.wait_s):
            trial.stuck, trial.note = 1, "job never started"
            return
        if self.train_model == "tiny":
            at = self.rng.randint(1, steps // 2)
            self.until(lambda: (job().get("progress") or {}).get("step", 0) >= at, self.wait_s)
        else:
            time.sleep(self.rng.uniform(0.0, 3.0))
        old = self.kill("worker-cpu")
        trial.recovery_s = self.wait_back("worker-cpu", old)
        done = self.until(
            lambda: (j := job())["status"] in ("succeeded", "failed", "cancelled") and j, self.wait_s
        )
        if not isinstance(done, dict):
            trial.stuck, trial.note = 1, f"job {job_id} not finished within {self.wait_s:.0f}s"
            return
        trial.acknowledged = 1
        progress = done.get("progress") or {}
        if done["status"] != "succeeded" or progress.get("step") != progress.get("total"):
            trial.lost, trial.note = 1, f"job ended {done['status']} at {progress}: {done.get('error')}"

    def agent(self, trial: Trial) -> None:
        message = f"Say something about chaos number {self.n}."
        self.ensure_collection()
        body = {"message": message, "collection": COLLECTION, "remember": True, "stream": True}
        conv: str | None = None
        old = 0
        with self.http.stream(
            "POST", f"{self.stack.url('agent')}/v1/pipelines/chat-documents/run", json=body
        ) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                conv = conv or event.get("conversation_id")
                if conv and event.get("type") in ("token", "delta"):
                    old = self.kill("agent")  # mid-answer
                    break
        trial.recovery_s = self.wait_back("agent", old) if old else None
        if not old:
            trial.note = "the answer ended before a token could be interrupted"
            return
        if trial.recovery_s is None:
            trial.stuck, trial.note = 1, f"agent not back within {self.wait_s:.0f}s"
            return
        trial.acknowledged = 1
        r = self.http.get(f"{self.stack.url('agent')}/v1/conversations/{conv}")
        said = json.dumps(r.json()) if r.status_code == 200 else ""
        if message not in said:
            trial.lost, trial.note = 1, f"the user's message is not in conversation {conv} ({r.status_code})"

    def inference(self, trial: Trial) -> None:
        url = f"{self.stack.url('inference')}/v1/completions"
        model = self.http.get(f"{self.stack.url('inference')}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 200, "stream": True}
        old = 0
        with self.http.stream("POST", url, json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data:"):
                    old = self.kill("inference")
                    break
        trial.recovery_s = self.wait_back("inference", old)
        if trial.recovery_s is None:
            trial.stuck, trial.note = 1, f"inference not back within {self.wait_s:.0f}s"
            return
        trial.acknowledged = 1
        again = self.http.post(url, json={"model": model, "prompt": "Hello", "max_tokens": 4})
        if again.status_code != 200 or not again.json()["choices"]:
            trial.lost, trial.note = 1, f"no answer after the restart: {again.status_code}"

    def tandem(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*TANDEM, *args],
            env=self.stack.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=self.wait_s + 300,
        )

    def supervisor(self, trial: Trial) -> None:
        run = self.stack.home / "run"
        names = sorted(p.stem for p in run.glob("*.pid"))
        trial.victim = name = self.rng.choice(names)

        def kill_supervisor() -> bool:
            sup = read_pid(run / f"{name}.pid")
            state = read_state(run / f"{name}.state.json")
            if sup is None or state is None or state.pid is None:
                trial.stuck, trial.note = 1, f"{name} has no supervisor and component to kill"
                return False
            os.kill(sup, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while pid_alive(state.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if pid_alive(state.pid):
                trial.orphans += 1
                trial.note += f" {name}'s process {state.pid} outlived its supervisor by 10 s;"
            started = time.monotonic()
            up = self.tandem("up", "--timeout", str(self.wait_s))
            trial.recovery_s = time.monotonic() - started
            if up.returncode != 0 or not self.ready():
                trial.stuck, trial.note = 1, f"tandem up did not recover {name}: {up.stdout[-300:]}"
                return False
            return True

        self.write_during(trial, kill_supervisor)
        down = self.tandem("down")
        if down.returncode != 0:
            trial.note += f" tandem down: {down.stdout[-300:]};"
        deadline = time.monotonic() + 10
        while home_processes(self.stack.home) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = home_processes(self.stack.home)
        trial.orphans += len(left)
        ports = [int(v) for k, v in self.stack.env.items() if k.startswith("TANDEM_") and k.endswith("_PORT")]
        trial.ports_left = sum(not port_free("127.0.0.1", port) for port in ports)
        if left or trial.ports_left:
            trial.note += f" after tandem down: processes {left}, {trial.ports_left} port(s) listening;"
        again = self.tandem("up", "--timeout", str(self.wait_s))  # a fresh stack for the next trial
        if again.returncode != 0:
            raise RuntimeError(f"tandem up after tandem down failed: {again.stdout[-500:]}")

    def run(self, target: str) -> Trial:
        self.n += 1
        trial = Trial(target)
        try:
            getattr(self, target.replace("-", "_"))(trial)
        except (httpx.HTTPError, RuntimeError, KeyError, ValueError, subprocess.SubprocessError) as exc:
            trial.stuck, trial.note = 1, f"{type(exc).__name__}: {exc}"
        return trial


def supervisor_table(trials: list[Trial]) -> str:
    """The supervisor target's four checks, per component whose supervisor was killed."""
    rows = [
        "| supervisor of | trials | no orphan | acknowledged | lost | up recovered | recovery p50 / max (s) "
        "| no port after down |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for victim in [*sorted({t.victim for t in trials}), "all"]:
        ts = [t for t in trials if victim in ("all", t.victim)]
        rec = [t.recovery_s for t in ts if t.recovery_s is not None and not t.stuck]
        times = f"{statistics.median(rec):.1f} / {max(rec):.1f}" if rec else "-"
        rows.append(
            f"| {victim} | {len(ts)} | {sum(t.orphans == 0 for t in ts)} | {sum(t.acknowledged for t in ts)} | "
            f"{sum(t.lost for t in ts)} | {sum(not t.stuck for t in ts)} | {times} | "
            f"{sum(t.ports_left == 0 for t in ts)} |"
        )
    return "\n".join(rows)


def table(report: Report) -> str:
    rows = [
        "| kill target | trials | acknowledged | lost | duplicated | stuck | recovery p50 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for target in TARGETS:
        ts = [t for t in report.trials if t.target == target]
        if not ts:
            continue
        rec = [t.recovery_s for t in ts if t.recovery_s is not None]
        rows.append(
            f"| {target} | {len(ts)} | {sum(t.acknowledged for t in ts)} | {sum(t.lost for t in ts)} | "
            f"{sum(t.duplicated for t in ts)} | {sum(t.stuck for t in ts)} | "
            f"{statistics.median(rec):.1f} |"
            if rec
            else f"| {target} | {len(ts)} | - | - | - | {len(ts)} | - |"
        )
    supervised = [t for t in report.trials if t.target == "supervisor"]
    return "\n".join(rows) + ("\n\n" + supervisor_table(supervised) if supervised else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10, help="kills per target")
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--wait", type=float, default=300, help="seconds a restart or a job may take")
    ap.add_argument("--out", type=Path, help="append every trial as a JSON line here, as it ends")
    ap.add_argument("--tally", type=Path, nargs="+", help="print the table of these --out files and stop")
    ap.add_argument("--keep", action="store_true", help="leave the stack running")
    ap.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="start no trial after this many minutes (the report says how many ran)",
    )
    ap.add_argument(
        "--train-model",
        choices=("served", "tiny"),
        default="served",
        help="worker-cpu's jobs train the served model (SmolLM2), or a 2-layer random Llama: the "
        "same job machinery (leases, checkpoints, resume) at a hundredth of the time per trial",
    )
    args = ap.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        ap.error(f"unknown target(s) {unknown}; choose from {', '.join(TARGETS)}")
    if args.tally:
        trials = [json.loads(ln) for f in args.tally for ln in f.read_text().splitlines() if ln.strip()]
        print(table(Report([Trial(**t) for t in trials])))
        return 0
    report = Report()
    with embedded_stack("tandem-chaos-", FAST_RECOVERY, keep=args.keep) as stack:
        chaos = Chaos(stack, random.Random(args.seed), args.wait, args.train_model)
        began = time.monotonic()
        for target in targets:
            for i in range(args.trials):
                if args.max_minutes is not None and time.monotonic() - began > args.max_minutes * 60:
                    print(f"{target}: stopped after {i} of {args.trials} trials (--max-minutes)", flush=True)
                    break
                trial = chaos.run(target)
                report.trials.append(trial)
                print(f"{target} trial {i + 1}/{args.trials}: {asdict(trial)}", flush=True)
                if args.out:  # one line per trial: a run stopped halfway keeps what it measured
                    with args.out.open("a") as f:
                        f.write(json.dumps(asdict(trial)) + "\n")
    print()
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
