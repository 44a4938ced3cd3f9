"""Distributed training: real torchrun processes, gloo on the CPU, 2 ranks, the tiny model.

1. ``resources`` is checked before anything is queued (400 naming the field), and
   ``procs_per_node`` above the worker's CPU cores fails the job at launch, naming it.
2. One step on 2 ranks (DDP; packed and unpacked) gives the loss and the gradients of one
   process on the same global batch.
3. FSDP2: 4 steps on 2 ranks equal 4 in one process, and the checkpoint (a full state dict
   gathered and written by rank 0) written by 2 ranks resumes on 1, and 1's on 2, to the
   same losses and weights as the uninterrupted run.
4. Through the API and a real Celery worker: a rank killed with ``kill -9`` makes torchrun
   restart the ranks, which resume from the last checkpoint; the job succeeds with every step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.common.config import CommonSettings
from services.trainer.app import create_app
from services.trainer.config import TrainerSettings
from tests.conftest import REPO_ROOT, auth
from tests.helpers.servers import celery_worker, serve_app
from tests.helpers.waiting import wait_until
from tests.trainer.conftest import jsonl
from tests.trainer.dist_probe import probe
from tests.trainer.test_api import ROWS, Harness, harness, job_body, upload  # noqa: F401 (fixture)
from tests.trainer.test_e2e import worker_env

TOL = 1e-4
PROBE = Path(__file__).with_name("dist_probe.py")
COUNT_ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Count to {n}."},
            {"role": "assistant", "content": " ".join(str(i) for i in range(1, n + 1))},
        ]
    }
    for n in range(1, 25)
]
# preference pairs and KTO rows on the same task; KTO's prompts come twice (a good and a bad
# completion), so prompt groups hold two rows and every row has a KL mismatch from another
PAIR_ROWS = [
    {
        "prompt": f"Count to {n}.",
        "chosen": " ".join(str(i) for i in range(1, n + 1)),
        "rejected": " ".join(str(i) for i in range(n, 0, -1)) + " go",
    }
    for n in range(1, 15)
]
KTO_ROWS = [
    {"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
    for r in PAIR_ROWS
    for side in ("chosen", "rejected")
]


def test_resources_are_checked_before_queueing(harness: Harness, api_key: str, tiny_model_path: Path) -> None:  # noqa: F811
    fid = upload(harness, api_key, jsonl(ROWS)).json()["id"]
    m = tiny_model_path
    harness.st.settings.max_procs_per_node = 4
    cases = [
        ({"nodes": 0}, "resources.nodes"),
        ({"procs_per_node": "many"}, "resources.procs_per_node"),
        ({"strategy": "zero3"}, "resources.strategy"),
        ({"gpus": 2}, "resources.gpus"),
        ({"procs_per_node": 8}, "resources.procs_per_node"),  # above TANDEM_TRAINER_MAX_PROCS_PER_NODE
        ({"nodes": 17}, "resources.nodes"),  # above TANDEM_TRAINER_MAX_NODES
    ]
    for resources, field in cases:
        resp = httpx.post(
            f"{harness.base}/v1/jobs",
            json=job_body(m, fid, resources=resources),
            headers=auth(api_key),
            timeout=60,
        )
        assert resp.status_code in (400, 422), (resources, resp.text)
        assert field in resp.json()["error"]["message"] or resp.json()["error"]["param"] == field, resp.text
    # ppo/grpo (rollouts on the inference service) stay one process: a 400 naming the field
    grpo = httpx.post(
        f"{harness.base}/v1/jobs",
        json=job_body(m, fid, type="grpo", reward="gsm8k_exact_match", resources={"procs_per_node": 2}),
        headers=auth(api_key),
        timeout=60,
    )
    assert grpo.status_code == 400 and grpo.json()["error"]["param"] == "resources", grpo.text
    assert "rollouts" in grpo.json()["error"]["message"], grpo.text  # says why
    assert harness.dispatched == []
    ok = httpx.post(
        f"{harness.base}/v1/jobs",
        json=job_body(m, fid, resources={"procs_per_node": 2, "strategy": "fsdp"}),
        headers=auth(api_key),
        timeout=60,
    )
    assert ok.status_code == 201, ok.text
    assert ok.json()["request"]["resources"] == {"nodes": 1, "procs_per_node": 2, "strategy": "fsdp"}


def test_more_procs_than_cpu_cores_fails_the_job_naming_the_setting(
    harness: Harness,  # noqa: F811
    api_key: str,
    tiny_model_path: Path,
) -> None:
    cores = len(os.sched_getaffinity(0))
    fid = upload(harness, api_key, jsonl(ROWS)).json()["id"]
    body = job_body(tiny_model_path, fid, resources={"procs_per_node": cores + 1})
    jid = httpx.post(f"{harness.base}/v1/jobs", json=body, headers=auth(api_key), timeout=60).json()["id"]
    assert harness.run_worker(jid) == "failed"
    job = httpx.get(f"{harness.base}/v1/jobs/{jid}", headers=auth(api_key)).json()
    assert f"resources.procs_per_node {cores + 1}" in job["error"]
    assert f"{cores} CPU cores" in job["error"], job["error"]


# ---- equality with one process (real torchrun, gloo)


def torchrun(*args: Any, timeout: float = 600) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        str(PROBE),
        *map(str, args),
    ]
    done = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def load(path: Path) -> dict[str, Any]:
    return dict(torch.load(path, weights_only=False))


def assert_same(one: dict[str, Any], two: dict[str, Any], *, grads: bool = True) -> None:
    assert [h["step"] for h in one["history"]] == [h["step"] for h in two["history"]]
    for a, b in zip(one["history"], two["history"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=TOL)
        # a norm of ~14 sums many products: relative (FSDP's reduce-scatter adds in another
        # order; an AMX Xeon's fp32 products differed from one process's by 2.4e-5 of it)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=TOL, abs=TOL)
        assert a.get("label_tokens") == b.get("label_tokens")
        for k in ("reward_accuracy", "kl"):  # the preference recipes' stats, summed over the ranks
            assert a.get(k) == pytest.approx(b.get(k), abs=TOL)
    if grads:
        assert one["grads"].keys() == two["grads"].keys() and one["grads"]
        for k in one["grads"]:
            torch.testing.assert_close(one["grads"][k], two["grads"][k], atol=TOL, rtol=TOL)
        # the gradients are not all zero (the filler passes of a short rank add nothing)
        assert max(float(g.abs().max()) for g in one["grads"].values()) > 1e-3
    for k in one["weights"]:
        # 2 x TOL: on an AMX Xeon one weight in 8192 of a KTO step differed by 1.1e-4
        torch.testing.assert_close(one["weights"][k], two["weights"][k], atol=2 * TOL, rtol=0)


@pytest.fixture()
def count_data(tmp_path: Path) -> Path:
    path = tmp_path / "count.jsonl"
    path.write_bytes(jsonl(COUNT_ROWS))
    return path


@pytest.mark.e2e
@pytest.mark.parametrize(("packing", "mode"), [("packed", "lora"), ("padded", "full")])
def test_two_ddp_ranks_give_the_loss_and_gradients_of_one_process(
    tiny_model_path: Path, count_data: Path, tmp_path: Path, packing: str, mode: str
) -> None:
    # packed: 3 packs a step over 2 ranks (one rank runs a filler pass); padded: a batch of 5 split 3 + 2
    probe(tmp_path / "one.pt", tiny_model_path, count_data, packing, "ddp", mode, 1, None)
    torchrun(tmp_path / "two.pt", tiny_model_path, count_data, packing, "ddp", mode, 1)
    assert_same(load(tmp_path / "one.pt"), load(tmp_path / "two.pt"))


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("kind", "packing", "mode"),
    [("dpo", "packed", "lora"), ("kto", "padded", "full"), ("kto", "packed", "lora")],
)
def test_two_ddp_ranks_give_the_preference_loss_and_gradients_of_one_process(
    tiny_model_path: Path, tmp_path: Path, kind: str, packing: str, mode: str
) -> None:
    # dpo packed: 3 packs of pairs a step (one rank runs a filler pass), the reference log-probs
    # computed by every rank; kto padded: a batch of 5 prompt groups split 3 + 2, whose KL
    # reference point (a mean over the whole batch's mismatched rows) is all-reduced
    data = tmp_path / f"{kind}.jsonl"
    data.write_bytes(jsonl(PAIR_ROWS if kind == "dpo" else KTO_ROWS))
    probe(tmp_path / "one.pt", tiny_model_path, data, packing, "ddp", mode, 3, None, kind)
    torchrun(tmp_path / "two.pt", tiny_model_path, data, packing, "ddp", mode, 3, "-", kind)
    one, two = load(tmp_path / "one.pt"), load(tmp_path / "two.pt")
    assert len(one["history"]) == 3
    if kind == "kto":  # the KL term is in play (not clamped to 0 on every step)
        assert any(h["kl"] > 0 for h in one["history"]), one["history"]
    assert_same(one, two)


@pytest.mark.e2e
def test_a_dpo_checkpoint_of_two_ranks_resumes_on_one(tiny_model_path: Path, tmp_path: Path) -> None:
    data = tmp_path / "dpo.jsonl"
    data.write_bytes(jsonl(PAIR_ROWS))
    args = (tiny_model_path, data, "packed", "fsdp", "lora", 3)  # the data's 3 steps; FSDP this time
    probe(tmp_path / "one.pt", *args, None, "dpo")  # type: ignore[arg-type]
    two_ck = tmp_path / "ck-two"
    torchrun(tmp_path / "two.pt", *args, two_ck, "dpo")
    one = load(tmp_path / "one.pt")
    assert_same(one, load(tmp_path / "two.pt"))
    assert sorted(p.name for p in two_ck.iterdir()) == ["step-2"]
    probe(tmp_path / "2to1.pt", *args, two_ck, "dpo")  # type: ignore[arg-type]
    resumed = load(tmp_path / "2to1.pt")
    assert [h["step"] for h in resumed["history"]] == [3]
    assert_same({**one, "history": one["history"][2:]}, resumed, grads=False)


@pytest.mark.e2e
def test_fsdp_matches_one_process_and_checkpoints_resume_on_another_world_size(
    tiny_model_path: Path, count_data: Path, tmp_path: Path
) -> None:
    args = (tiny_model_path, count_data, "packed", "fsdp", "full", 4)
    one_ck, two_ck = tmp_path / "ck-one", tmp_path / "ck-two"
    probe(tmp_path / "one.pt", *args, one_ck)  # type: ignore[arg-type]
    torchrun(tmp_path / "two.pt", *args, two_ck)
    one, two = load(tmp_path / "one.pt"), load(tmp_path / "two.pt")
    assert_same(one, two)
    # both kept their step-2 checkpoint only (the last step writes none): resume each on the other size
    assert sorted(p.name for p in two_ck.iterdir()) == ["step-2"]
    from_two, from_one = tmp_path / "from-two", tmp_path / "from-one"
    shutil.copytree(two_ck, from_two)
    shutil.copytree(one_ck, from_one)
    probe(tmp_path / "2to1.pt", *args, from_two)  # type: ignore[arg-type]
    torchrun(tmp_path / "1to2.pt", *args, from_one)
    tail = {**one, "history": one["history"][2:]}
    for resumed in (load(tmp_path / "2to1.pt"), load(tmp_path / "1to2.pt")):
        assert [h["step"] for h in resumed["history"]] == [3, 4]
        assert_same(tail, resumed, grads=False)


def test_a_rank_error_file_is_replaced_whole_so_torchrun_never_reads_it_half_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torchrun parses a failed rank's error file as it finds it; torch's own handler truncates
    # it first, so a torchrun looking in between crashed on the empty file instead of restarting
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from services.trainer.rank import error_handler

    path = tmp_path / "error.json"
    path.write_text("{}")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    with path.open() as before:  # the file a reader had open (or was about to parse)
        try:
            raise RuntimeError("Connection closed by peer")
        except RuntimeError as e:
            error_handler().record_exception(e)
        assert before.read() == "{}"  # a new file took its place; the old one was never truncated
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert failure.message["message"] == "RuntimeError: Connection closed by peer"  # type: ignore[index]
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]  # no temp file left behind


# ---- through the API and real workers


class Api:
    def __init__(self, base: str, key: str) -> None:
        self.base, self.key = base, key

    def get(self, path: str) -> Any:
        return httpx.get(f"{self.base}/v1{path}", headers=auth(self.key), timeout=30).json()

    def submit(self, body: dict[str, Any], rows: list[dict[str, Any]] = COUNT_ROWS) -> str:
        files = {"file": ("c.jsonl", jsonl(rows))}
        body["dataset"] = httpx.post(f"{self.base}/v1/files", files=files, headers=auth(self.key)).json()[
            "id"
        ]
        resp = httpx.post(f"{self.base}/v1/jobs", json=body, headers=auth(self.key), timeout=60)
        assert resp.status_code == 201, resp.text
        return str(resp.json()["id"])

    def logs(self, jid: str) -> list[str]:
        return [x["message"] for x in self.get(f"/jobs/{jid}/logs")["data"]]

    def finished(self, jid: str, log: Path) -> dict[str, Any]:
        done: dict[str, Any] = wait_until(
            lambda: (j := self.get(f"/jobs/{jid}"))["status"] in ("succeeded", "failed") and j,
            600,
            "the job",
            log=log,
        )
        assert done["status"] == "succeeded", done["error"]
        total = done["progress"]["total"]
        assert done["progress"] == {"step": total, "total": total}
        assert [m["step"] for m in self.get(f"/jobs/{jid}/metrics")["data"]] == list(range(1, total + 1))
        return done


def dist_job(resources: dict[str, Any], max_steps: int, model: Path, **extra: Any) -> dict[str, Any]:
    return {
        "type": "sft",
        "base_model": str(model),
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "max_tokens_per_pack": 128,
        "resources": resources,
        "hyperparameters": {
            "n_epochs": 20,
            "max_steps": max_steps,
            "packs_per_step": 2,
            "learning_rate": 1e-2,
            "checkpoint_every": 2,
            "seed": 7,
        },
        **extra,
    }


@pytest.fixture()
def log(tmp_path: Path) -> Path:
    """The workers' output (shown when a wait times out)."""
    return tmp_path / "workers.log"


@pytest.fixture()
def api_app(tandem_env: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("TANDEM_MODEL_ROOTS", f"{tiny_model_path.parent}:{tandem_env / 'models'}")
    return create_app(CommonSettings(), TrainerSettings())


@pytest.mark.e2e
def test_a_rank_killed_with_kill_9_is_restarted_and_the_job_resumes_from_its_checkpoint(
    api_app: Any, tandem_env: Path, tiny_model_path: Path, api_key: str, log: Path
) -> None:
    body = dist_job({"nodes": 1, "procs_per_node": 2, "strategy": "fsdp"}, 16, tiny_model_path)
    with serve_app(api_app) as base, celery_worker(worker_env({}), log, "w1") as w1:
        api = Api(base, api_key)
        jid = api.submit(body)
        wait_until(lambda: api.get(f"/jobs/{jid}")["progress"]["step"] >= 3, 600, "step 3", log=log)
        ranks = next(m for m in api.logs(jid) if m.startswith("torchrun: 2 ranks"))
        pid = int(re.search(r"1=[^:,]+:(\d+)", ranks).group(1))  # type: ignore[union-attr]
        os.kill(pid, signal.SIGKILL)  # rank 1 dies mid-job
        done = api.finished(jid, log)
        messages = api.logs(jid)
        assert w1.poll() is None  # the worker itself lived on
    # the step count of an uninterrupted run, in one attempt of the same worker
    assert done["progress"]["total"] == 16 and done["attempts"] == 1
    assert any("(fsdp, restart 1)" in m for m in messages), messages
    # "resumed from checkpoint step N (PATH)"
    resumed = [int(m.split()[4]) for m in messages if m.startswith("resumed from checkpoint step")]
    assert resumed and resumed[0] >= 2 and resumed[0] % 2 == 0, messages
    artifact = tandem_env / "models" / "trainer" / jid  # rank 0 gathered the shards and saved the adapter
    assert json.loads((artifact / "adapter_config.json").read_text())["r"] == 4
    assert (artifact / "adapter_model.safetensors").is_file()


@pytest.mark.e2e
def test_a_two_node_job_meets_a_second_worker_at_the_rendezvous(
    api_app: Any, tiny_model_path: Path, api_key: str, log: Path
) -> None:
    # two workers of the cpu queue stand for two machines (one process each)
    env = worker_env({})
    body = dist_job({"nodes": 2, "procs_per_node": 1, "strategy": "ddp"}, 4, tiny_model_path)
    with serve_app(api_app) as base, celery_worker(env, log, "a"), celery_worker(env, log, "b"):
        api = Api(base, api_key)
        jid = api.submit(body)
        api.finished(jid, log)
        messages = api.logs(jid)
    assert any(m.startswith("torchrun: 2 ranks (ddp, restart 0)") for m in messages), messages


@pytest.mark.e2e
def test_a_dpo_job_with_resources_trains_on_two_ranks_and_succeeds(
    api_app: Any, tandem_env: Path, tiny_model_path: Path, api_key: str, log: Path
) -> None:
    # the held-out metrics (eval_fraction) are computed by both ranks, each its share
    body = dist_job(
        {"nodes": 1, "procs_per_node": 2, "strategy": "ddp"},
        4,
        tiny_model_path,
        type="dpo",
        eval_fraction=0.2,
    )
    with serve_app(api_app) as base, celery_worker(worker_env({}), log, "w1"):
        api = Api(base, api_key)
        jid = api.submit(body, PAIR_ROWS)
        done = api.finished(jid, log)
        messages = api.logs(jid)
    assert any(m.startswith("torchrun: 2 ranks (ddp, restart 0)") for m in messages), messages
    assert any(m.startswith("held-out eval after:") for m in messages), messages
    assert {"reward_accuracy", "reward_margin"} <= done["metrics"].keys(), done["metrics"]
    artifact = tandem_env / "models" / "trainer" / jid  # rank 0 saved the adapter
    assert json.loads((artifact / "tandem_training.json").read_text())["type"] == "dpo"
    assert (artifact / "adapter_model.safetensors").is_file()
