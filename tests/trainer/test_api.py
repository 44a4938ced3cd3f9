"""The trainer API over real HTTP with a real Valkey: uploads, validation before queueing,
tenant isolation, a job run by the worker's task body, progress over SSE, artifacts, cancel,
and orphan recovery. The Celery hop is replaced by a recording double here (the real
worker subprocess is in test_e2e.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.common.config import CommonSettings
from services.trainer.app import create_app
from services.trainer.config import TrainerSettings
from services.trainer.runner import execute, recover_orphans
from tests.conftest import auth
from tests.helpers.servers import serve_app
from tests.helpers.sse import named_events
from tests.trainer.conftest import count_to_rows, jsonl

ROWS = count_to_rows(12)


class Harness:
    def __init__(self, base: str, app: Any) -> None:
        self.base = base
        self.app = app
        self.dispatched: list[tuple[str, str]] = []
        self.st = app.state.trainer
        self.st.dispatch = lambda job_id, queue: self.dispatched.append((job_id, queue))

    def run_worker(self, job_id: str) -> str:
        return execute(job_id, store=self.st.store, common=self.st.common, settings=self.st.settings)


@contextmanager
def serving(
    model: Path, home: Path, monkeypatch: pytest.MonkeyPatch, settings: TrainerSettings | None = None
) -> Iterator[Harness]:
    """The trainer API over HTTP, ``model``'s folder and the home's models allowed as roots."""
    monkeypatch.setenv("TANDEM_MODEL_ROOTS", f"{model.parent}:{home / 'models'}")
    app = create_app(
        CommonSettings(), settings or TrainerSettings(heartbeat_interval_s=0.2, stale_after_s=10.0)
    )
    with serve_app(app) as base:
        yield Harness(base, app)


@pytest.fixture()
def harness(tandem_env: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    with serving(tiny_model_path, tandem_env, monkeypatch) as h:
        yield h


def upload(h: Harness, key: str, data: bytes, name: str = "train.jsonl") -> httpx.Response:
    return httpx.post(
        f"{h.base}/v1/files", files={"file": (name, data, "application/jsonl")}, headers=auth(key)
    )


def job_body(model: Path, dataset: str, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": "sft",
        "base_model": str(model),
        "dataset": dataset,
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "max_tokens_per_pack": 256,
        "hyperparameters": {"max_steps": 3, "learning_rate": 1e-3, "checkpoint_every": 2},
    }
    body.update(kw)
    return body


def test_upload_validates_and_names_line_and_field(harness: Harness, api_key: str, gsm8k_rows: bytes) -> None:
    ok = upload(harness, api_key, gsm8k_rows)
    assert ok.status_code == 201, ok.text
    assert ok.json()["format"] == "gsm8k" and ok.json()["rows"] == 24 and ok.json()["id"].startswith("file-")

    bad = upload(harness, api_key, b'{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": "b"\n')
    assert bad.status_code == 400
    assert "line 2" in bad.json()["error"]["message"] and "malformed JSON" in bad.json()["error"]["message"]

    missing = upload(harness, api_key, b'{"instruction": "a", "output": "b"}\n{"instruction": "c"}\n')
    assert missing.status_code == 400
    err = missing.json()["error"]
    assert "line 2" in err["message"] and "'output' is missing" in err["message"] and err["param"] == "output"

    empty = upload(harness, api_key, b"")
    assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]

    blank = (
        b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n' * 2
        + b'{"prompt": "a", "chosen": "", "rejected": "c"}\n'
    )
    refused = upload(harness, api_key, blank)
    assert refused.status_code == 400, refused.text
    assert "line 3" in refused.json()["error"]["message"] and refused.json()["error"]["param"] == "chosen"


def test_bad_job_requests_are_refused_before_queueing(
    harness: Harness, api_key: str, tiny_model_path: Path, gsm8k_rows: bytes
) -> None:
    fid = upload(harness, api_key, jsonl(ROWS)).json()["id"]
    gsm = upload(harness, api_key, gsm8k_rows).json()["id"]
    m = tiny_model_path
    cases = [
        (job_body(m, fid, base_model="no-such-model"), "unknown base_model 'no-such-model'"),
        (job_body(m, fid, base_model="/etc"), "outside the allowed roots"),
        (
            job_body(m, fid, lora={"target_modules": ["q_proj", "attn_qkv"]}),
            "'attn_qkv' not found in the model",
        ),
        (job_body(m, gsm, max_tokens_per_pack=64), "more than max_tokens_per_pack=64"),
        (job_body(m, fid, hyperparameters={"learning_rate": 5}), "hyperparameters.learning_rate"),
        (job_body(m, fid, hyperparameters={"max_steps": 0}), "hyperparameters.max_steps"),
        (job_body(m, fid, hyperparameters={"lerning_rate": 1e-3}), "hyperparameters.lerning_rate"),
        (job_body(m, fid, type="dpo"), "suits sft, rl jobs, not dpo"),
        (job_body(m, fid, type="grpo"), "needs 'reward'"),
        (job_body(m, fid, type="grpo", reward="nope"), "no reward function named 'nope'"),
        (job_body(m, "file-missing"), "no file with id 'file-missing'"),
    ]
    for body, needle in cases:
        resp = httpx.post(f"{harness.base}/v1/jobs", json=body, headers=auth(api_key), timeout=60)
        assert resp.status_code in (400, 404), (needle, resp.status_code, resp.text)
        assert needle in resp.json()["error"]["message"], (needle, resp.json())
    assert harness.dispatched == []


def test_job_runs_reports_progress_over_sse_and_serves_artifacts(
    harness: Harness, api_key: str, other_key: str, tiny_model_path: Path
) -> None:
    fid = upload(harness, api_key, jsonl(ROWS)).json()["id"]
    resp = httpx.post(
        f"{harness.base}/v1/jobs",
        json=job_body(tiny_model_path, fid, eval_dataset=fid),
        headers=auth(api_key),
        timeout=60,
    )
    assert resp.status_code == 201, resp.text
    job = resp.json()
    assert job["status"] == "queued" and harness.dispatched == [(job["id"], "cpu")]
    jid = job["id"]

    # tenant isolation
    assert httpx.get(f"{harness.base}/v1/jobs/{jid}", headers=auth(other_key)).status_code == 404
    assert httpx.get(f"{harness.base}/v1/files/{fid}", headers=auth(other_key)).status_code == 404
    assert all(
        j["id"] != jid for j in httpx.get(f"{harness.base}/v1/jobs", headers=auth(other_key)).json()["data"]
    )
    theirs = httpx.get(f"{harness.base}/v1/jobs/{jid}/events", headers=auth(other_key))
    assert theirs.status_code == 404 and theirs.json()["error"]["param"] == "job_id", theirs.text

    events: list[tuple[str, dict[str, Any]]] = []

    def watch() -> None:
        with httpx.stream(
            "GET", f"{harness.base}/v1/jobs/{jid}/events", headers=auth(api_key), timeout=120
        ) as s:
            events.extend(named_events(s.iter_lines()))

    watcher = threading.Thread(target=watch)
    watcher.start()
    assert harness.run_worker(jid) == "succeeded"
    watcher.join(60)
    assert not watcher.is_alive(), "SSE stream did not end with the job"
    progress = [d for k, d in events if k == "progress"]
    assert [p["step"] for p in progress] == [1, 2, 3] and progress[-1]["total"] == 3
    assert "loss" in progress[-1]["metrics"] and "padding_ratio" in progress[-1]["metrics"]
    assert [d["status"] for k, d in events if k == "status"] == ["queued", "running", "succeeded"]

    done = httpx.get(f"{harness.base}/v1/jobs/{jid}", headers=auth(api_key)).json()
    assert done["status"] == "succeeded" and done["progress"] == {"step": 3, "total": 3}
    assert done["metrics"]["tokens_per_s"] > 0 and done["error"] is None
    assert done["metrics"]["eval_loss_after"] > 0 and done["eval_dataset"] == fid
    assert done["metrics"]["eval_loss_before"] > done["metrics"]["eval_loss_after"]
    metrics = httpx.get(f"{harness.base}/v1/jobs/{jid}/metrics", headers=auth(api_key)).json()["data"]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all("learning_rate" in m for m in metrics)
    logs = httpx.get(f"{harness.base}/v1/jobs/{jid}/logs", headers=auth(api_key)).json()["data"]
    assert any("checkpoint at step 2" in line["message"] for line in logs)

    arts = httpx.get(f"{harness.base}/v1/jobs/{jid}/artifacts", headers=auth(api_key)).json()["data"]
    paths = {a["path"] for a in arts}
    assert "final/adapter_model.safetensors" in paths and "final/adapter_config.json" in paths
    assert "checkpoints/step-2/trainable.safetensors" in paths and "checkpoints/step-2/state.pt" in paths
    cfg = httpx.get(
        f"{harness.base}/v1/jobs/{jid}/artifacts/final/adapter_config.json", headers=auth(api_key)
    )
    assert cfg.status_code == 200 and cfg.json()["r"] == 4
    assert (
        httpx.get(f"{harness.base}/v1/jobs/{jid}/artifacts/final/../../x", headers=auth(api_key)).status_code
        == 404
    )
    # the websocket replays the same events (browser-style auth through subprotocols)
    from websockets.sync.client import connect

    ws_url = harness.base.replace("http://", "ws://") + f"/v1/ws/jobs/{jid}"
    with connect(ws_url, subprotocols=["tandem.bearer", api_key]) as ws:  # type: ignore[list-item]
        assert ws.subprotocol == "tandem.bearer"
        got = [json.loads(m) for m in ws]
    # another tenant's socket is refused before it opens (closed unaccepted: the handshake's 403)
    from websockets.exceptions import InvalidStatus

    with pytest.raises(InvalidStatus, match="403"):
        connect(ws_url, subprotocols=["tandem.bearer", other_key])  # type: ignore[list-item]
    assert [e["step"] for e in got if e["type"] == "progress"] == [1, 2, 3]
    assert got[-1] == {**got[-1], "type": "status", "status": "succeeded"}
    again = httpx.post(f"{harness.base}/v1/jobs/{jid}/cancel", headers=auth(api_key))
    assert again.status_code == 409


def test_cancel_of_a_queued_job_and_idempotent_task(
    harness: Harness, api_key: str, tiny_model_path: Path
) -> None:
    fid = upload(harness, api_key, jsonl(ROWS)).json()["id"]
    jid = httpx.post(
        f"{harness.base}/v1/jobs", json=job_body(tiny_model_path, fid), headers=auth(api_key), timeout=60
    ).json()["id"]
    resp = httpx.post(f"{harness.base}/v1/jobs/{jid}/cancel", headers=auth(api_key))
    assert resp.status_code == 200 and resp.json()["status"] == "cancelled"
    assert harness.run_worker(jid) == "cancelled"  # the queued message arrives later: nothing runs
    assert httpx.get(f"{harness.base}/v1/jobs/{jid}", headers=auth(api_key)).json()["progress"]["step"] == 0


def test_orphaned_running_job_is_requeued_once(harness: Harness, api_key: str, tiny_model_path: Path) -> None:
    fid = upload(harness, api_key, jsonl(ROWS)).json()["id"]
    jid = httpx.post(
        f"{harness.base}/v1/jobs", json=job_body(tiny_model_path, fid), headers=auth(api_key), timeout=60
    ).json()["id"]
    store = harness.st.store
    now = [1_000.0]
    store.clock = lambda: now[0]  # leases run on this clock: the test moves it instead of sleeping
    # a worker took it and died: running, one attempt, lease held but no longer renewed
    assert store.acquire_lease(jid, "dead-worker", 0.5)  # as if its TTL (stale_after_s) ran out
    store.set_status(jid, "running", attempts=1)
    requeue: list[tuple[str, str]] = []
    now[0] += 0.4
    assert (
        recover_orphans(store, harness.st.settings, lambda j, q: requeue.append((j, q))) == []
    )  # lease alive
    assert store.lease_owner(jid) == "dead-worker" and not store.acquire_lease(jid, "other", 0.5)
    now[0] += 0.2  # past the lease's 0.5 s
    assert store.lease_owner(jid) is None
    assert recover_orphans(store, harness.st.settings, lambda j, q: requeue.append((j, q))) == [jid]
    assert recover_orphans(store, harness.st.settings, lambda j, q: requeue.append((j, q))) == []
    assert requeue == [(jid, "cpu")]
    assert store.job(jid)["status"] == "queued"
    assert harness.run_worker(jid) == "succeeded"
    assert store.job(jid)["attempts"] == "2"


KTO_ROWS = [
    row
    for i in range(12)
    for row in (
        {"prompt": [{"role": "user", "content": f"Say yes {i}"}], "completion": "yes yes", "label": True},
        {"prompt": [{"role": "user", "content": f"Say yes {i}"}], "completion": "no no no", "label": False},
    )
]


def test_kto_job_with_eval_fraction_reports_held_out_metrics_as_events(
    harness: Harness, api_key: str, tiny_model_path: Path
) -> None:
    up = upload(harness, api_key, jsonl(KTO_ROWS))
    assert up.status_code == 201 and up.json()["format"] == "kto" and up.json()["kinds"] == ["kto"]
    fid = up.json()["id"]
    pref = upload(harness, api_key, jsonl([{"prompt": "a", "chosen": "b", "rejected": "c"}])).json()["id"]
    same_prompt = upload(
        harness,
        api_key,
        jsonl([{"prompt": "same", "completion": c, "label": c == "yes"} for c in ("yes", "no")]),
    ).json()["id"]
    long = upload(
        harness, api_key, jsonl([{"prompt": "q", "completion": "yes " * 30, "label": True}, *KTO_ROWS[:3]])
    ).json()["id"]
    m = tiny_model_path
    for body, needle, param in [
        (job_body(m, pref, type="kto"), "suits dpo jobs, not kto", "dataset"),
        (job_body(m, fid, type="dpo"), "suits kto jobs, not dpo", "dataset"),
        (job_body(m, same_prompt, type="kto", eval_fraction=0.5), "distinct prompt", "eval_fraction"),
        (
            job_body(m, long, type="kto", max_tokens_per_pack=64),
            "line 1 has 97 tokens (prompt + completion",
            "max_tokens_per_pack",
        ),
        (job_body(m, fid, type="kto", hyperparameters={"loss_type": "hinge"}), "only applies to dpo", None),
    ]:
        resp = httpx.post(f"{harness.base}/v1/jobs", json=body, headers=auth(api_key), timeout=60)
        assert resp.status_code == 400, (needle, resp.text)
        assert needle in resp.json()["error"]["message"], (needle, resp.json())
        if param:
            assert resp.json()["error"]["param"] == param
    assert harness.dispatched == []

    body = job_body(
        tiny_model_path,
        fid,
        type="kto",
        eval_fraction=0.25,
        hyperparameters={
            "max_steps": 6,
            "n_epochs": 6,
            "learning_rate": 5e-3,
            "beta": 0.5,
            "checkpoint_every": 2,
        },
    )
    created = httpx.post(f"{harness.base}/v1/jobs", json=body, headers=auth(api_key), timeout=60)
    assert created.status_code == 201, created.text
    job = created.json()
    assert job["type"] == "kto" and job["request"]["eval_fraction"] == 0.25
    hp = job["request"]["hyperparameters"]
    assert hp["beta"] == 0.5 and hp["learning_rate"] == 5e-3  # the caller's values kept
    assert hp["desirable_weight"] is None  # left to the recipe: balanced to the counts
    assert harness.run_worker(job["id"]) == "succeeded"
    done = httpx.get(f"{harness.base}/v1/jobs/{job['id']}", headers=auth(api_key)).json()
    metrics = done["metrics"]
    for name in ("loss", "accuracy", "margin"):
        assert f"eval_{name}_before" in metrics and f"eval_{name}_after" in metrics, metrics
    assert metrics["eval_loss_after"] < metrics["eval_loss_before"]
    assert metrics["eval_margin_after"] > metrics["eval_margin_before"] == 0.0
    assert "reward_accuracy" in metrics and "kl" in metrics
    events = harness.st.store.r.xrange(f"tandem:trainer:job:{job['id']}:events")
    evals = [json.loads(f["data"]) for _, f in events if f["type"] == "eval"]
    assert [e["phase"] for e in evals] == ["before", "after"]
    assert evals[1]["metrics"]["eval_accuracy_after"] == metrics["eval_accuracy_after"]
    logs = httpx.get(f"{harness.base}/v1/jobs/{job['id']}/logs", headers=auth(api_key)).json()["data"]
    assert any("kto:" in x["message"] and "prompt groups" in x["message"] for x in logs)
