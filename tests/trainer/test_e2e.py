"""End to end with a real Celery worker (subprocess) and Valkey.

1. A worker killed with ``kill -9`` mid-job: a second worker finds the stale heartbeat,
   requeues the job, resumes it from its last checkpoint, and it ends with the same step
   count and final loss as the same job run without interruption.
2. A KTO LoRA job with ``eval_fraction`` on the tiny model, run by the real worker: it
   succeeds and reports held-out loss, accuracy and margin before and after.
3. GSM8K rows uploaded, a LoRA SFT job on the real SmolLM2-135M watched over SSE,
   published to a live inference service and chatted with there.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.common.auth import KeyStore
from services.common.config import CommonSettings
from services.trainer.app import create_app
from services.trainer.config import TrainerSettings
from tests.conftest import REPO_ROOT, auth
from tests.helpers.servers import celery_worker, serve_app
from tests.helpers.sse import named_events
from tests.helpers.waiting import wait_until
from tests.trainer.conftest import count_to_rows, jsonl

pytestmark = pytest.mark.e2e

ROWS = count_to_rows(24)
FAST_RECOVERY = {
    "TANDEM_TRAINER_HEARTBEAT_INTERVAL_S": "0.5",
    "TANDEM_TRAINER_STALE_AFTER_S": "5",
    "TANDEM_TRAINER_RECOVERY_INTERVAL_S": "1",
}


def worker_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()}
    env.update(extra)
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env


def get_job(base: str, key: str, jid: str) -> dict[str, Any]:
    return httpx.get(f"{base}/v1/jobs/{jid}", headers=auth(key), timeout=30).json()


def create_job(base: str, key: str, body: dict[str, Any]) -> str:
    created = httpx.post(f"{base}/v1/jobs", json=body, headers=auth(key), timeout=120)
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def finished_job(base: str, key: str, jid: str, log: Path, timeout: float = 300) -> dict[str, Any]:
    """The job once it has succeeded or failed (the worker's log tail if it never does)."""
    return wait_until(
        lambda: (j := get_job(base, key, jid))["status"] in ("succeeded", "failed") and j,
        timeout,
        f"job {jid} finishes",
        log=log,
    )


def test_killed_worker_job_is_resumed_to_the_same_result(
    tandem_env: Path, tiny_model_path: Path, api_key: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TANDEM_MODEL_ROOTS", f"{tiny_model_path.parent}:{tandem_env / 'models'}")
    for k, v in FAST_RECOVERY.items():
        monkeypatch.setenv(k, v)
    env = worker_env({})
    log = tmp_path / "worker.log"
    app = create_app(CommonSettings(), TrainerSettings())
    body = {
        "type": "sft",
        "base_model": str(tiny_model_path),
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "max_tokens_per_pack": 256,
        # Enough steps that the kill lands mid-job even on a fast, quiet machine (a tiny step
        # takes ~0.1 s there; the poll that sees step 3 can lag by a few steps).
        "hyperparameters": {
            "n_epochs": 20,
            "max_steps": 40,
            "learning_rate": 1e-2,
            "checkpoint_every": 2,
            "seed": 7,
        },
    }
    with serve_app(app) as base:
        fid = httpx.post(
            f"{base}/v1/files", files={"file": ("c.jsonl", jsonl(ROWS))}, headers=auth(api_key)
        ).json()["id"]
        body["dataset"] = fid
        with celery_worker(env, log, "w1") as w1:
            ref = create_job(base, api_key, body)
            wait_until(
                lambda: get_job(base, api_key, ref)["status"] == "succeeded",
                300,
                "the reference job",
                log=log,
            )
            jid = create_job(base, api_key, body)
            wait_until(lambda: get_job(base, api_key, jid)["progress"]["step"] >= 3, 300, "step 3", log=log)
            os.kill(w1.pid, signal.SIGKILL)  # the worker dies mid-job, without acking
            w1.wait()
        assert get_job(base, api_key, jid)["status"] == "running"
        with celery_worker(env, log, "w2"):
            done = finished_job(base, api_key, jid, log)
        assert done["status"] == "succeeded", done["error"]
        reference = get_job(base, api_key, ref)
        assert done["attempts"] == 2
        total = reference["progress"]["total"]
        assert total >= 6 and done["progress"] == reference["progress"] == {"step": total, "total": total}
        assert done["metrics"]["loss"] == pytest.approx(reference["metrics"]["loss"], abs=1e-4)
        steps = [
            m["step"]
            for m in httpx.get(f"{base}/v1/jobs/{jid}/metrics", headers=auth(api_key)).json()["data"]
        ]
        assert steps == list(range(1, total + 1))
        logs = [
            x["message"]
            for x in httpx.get(f"{base}/v1/jobs/{jid}/logs", headers=auth(api_key)).json()["data"]
        ]
        assert any("requeued" in m for m in logs) and any("resumed from checkpoint" in m for m in logs)


def test_kto_job_through_a_real_worker_reports_eval_metrics(
    tandem_env: Path, tiny_model_path: Path, api_key: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TANDEM_MODEL_ROOTS", f"{tiny_model_path.parent}:{tandem_env / 'models'}")
    rows = [
        row
        for i in range(16)
        for row in (
            {"prompt": [{"role": "user", "content": f"Say yes {i}"}], "completion": "yes yes", "label": True},
            {"prompt": f"Say yes {i}", "completion": "no no no", "label": False},
        )
    ]
    log = tmp_path / "worker.log"
    app = create_app(CommonSettings(), TrainerSettings())
    with serve_app(app) as base, celery_worker(worker_env({}), log, "w1"):
        up = httpx.post(f"{base}/v1/files", files={"file": ("kto.jsonl", jsonl(rows))}, headers=auth(api_key))
        assert up.status_code == 201 and up.json()["format"] == "kto", up.text
        body = {
            "type": "kto",
            "base_model": str(tiny_model_path),
            "dataset": up.json()["id"],
            "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            "max_tokens_per_pack": 256,
            "eval_fraction": 0.25,
            "hyperparameters": {"n_epochs": 6, "learning_rate": 5e-3, "beta": 0.5},
        }
        jid = create_job(base, api_key, body)
        done = finished_job(base, api_key, jid, log)
    assert done["status"] == "succeeded", done["error"]
    m = done["metrics"]
    assert m["eval_loss_after"] < m["eval_loss_before"]
    assert m["eval_accuracy_after"] > m["eval_accuracy_before"]
    assert m["eval_margin_after"] > m["eval_margin_before"]


def test_lora_sft_on_smollm2_over_sse_then_chat_with_the_published_adapter(
    tandem_env: Path,
    smollm2_path: Path,
    api_key: str,
    key_store: KeyStore,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    gsm8k_rows: bytes,
) -> None:
    from services.inference.app import create_app as create_inference
    from services.inference.config import InferenceSettings

    service_key = key_store.create("system", "service", operator=True)[0]
    monkeypatch.setenv("TANDEM_MODEL_ROOTS", f"{smollm2_path.parent}:{tandem_env / 'models'}")
    monkeypatch.setenv("TANDEM_SERVICE_API_KEY", service_key)
    inference = create_inference(
        CommonSettings(), InferenceSettings(model=str(smollm2_path), max_batch_size=4)
    )
    log = tmp_path / "worker.log"
    with serve_app(inference) as inf_url:
        monkeypatch.setenv("TANDEM_INFERENCE_URL", inf_url)
        app = create_app(CommonSettings(), TrainerSettings())
        with serve_app(app) as base, celery_worker(worker_env({}), log, "w1"):
            rows = b"\n".join(gsm8k_rows.splitlines()[:12]) + b"\n"
            up = httpx.post(f"{base}/v1/files", files={"file": ("gsm8k.jsonl", rows)}, headers=auth(api_key))
            assert up.status_code == 201, up.text
            body = {
                "type": "sft",
                "base_model": str(smollm2_path),
                "dataset": up.json()["id"],
                "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
                "max_tokens_per_pack": 1024,
                "hyperparameters": {"max_steps": 3, "n_epochs": 2, "learning_rate": 2e-4},
                "publish": True,
            }
            jid = create_job(base, api_key, body)
            with httpx.stream("GET", f"{base}/v1/jobs/{jid}/events", headers=auth(api_key), timeout=600) as s:
                events = named_events(s.iter_lines())
            statuses = [d["status"] for k, d in events if k == "status"]
            job = get_job(base, api_key, jid)
            assert statuses[-1] == "succeeded", (job["error"], log.read_text()[-3000:])
            progress = [d for k, d in events if k == "progress"]
            assert [p["step"] for p in progress] == [1, 2, 3]
            assert all(p["metrics"]["loss"] > 0 for p in progress)
            assert job["published"] and job["fine_tuned_model"]
            chat = httpx.post(
                f"{inf_url}/v1/chat/completions",
                json={
                    "model": job["fine_tuned_model"],
                    "messages": [
                        {"role": "user", "content": "Tom has 3 apples and buys 2 more. How many apples?"}
                    ],
                    "max_tokens": 24,
                    "temperature": 0,
                },
                headers=auth(api_key),
                timeout=120,
            )
            assert chat.status_code == 200, chat.text
            answer = chat.json()["choices"][0]["message"]["content"]
            assert answer.strip()
            print(f"\nadapter {job['fine_tuned_model']} answered: {answer!r}")
