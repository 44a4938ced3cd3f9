"""Lineage and publishing: a job may start from the caller's own fine-tunes only (by
``ft-...`` name or by its weights' path), never from another tenant's, and a
``publish: true`` job is checked against the inference service's capabilities before it
is queued. Real trainer and inference services over HTTP, a real Valkey, the tiny model;
the Celery hop is the worker's task body run in-process (as in test_api.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.common.auth import KeyStore
from services.common.config import CommonSettings
from services.trainer.app import create_app
from services.trainer.config import TrainerSettings
from services.trainer.publish import publish
from services.trainer.runner import execute
from tests.conftest import auth
from tests.helpers.servers import free_port, serve_app
from tests.trainer.conftest import count_to_rows, jsonl

ROWS = count_to_rows(8)


def _chat_status(inference: str, key: str, model: str, content: str) -> int:
    chat = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return httpx.post(
        f"{inference}/v1/chat/completions", json=chat, headers=auth(key), timeout=60
    ).status_code


class Stack:
    def __init__(self, base: str, app: Any, inference: str | None) -> None:
        self.base = base
        self.inference = inference
        self.st = app.state.trainer
        self.st.dispatch = lambda job_id, queue: None

    def run(self, job_id: str) -> dict[str, Any]:
        common = self.st.common
        execute(
            job_id,
            store=self.st.store,
            common=common,
            settings=self.st.settings,
            publish=lambda jid, spec, path: publish(common, jid, spec, path),
        )
        return self.st.store.job(job_id)

    def upload(self, key: str) -> str:
        r = httpx.post(
            f"{self.base}/v1/files",
            files={"file": ("t.jsonl", jsonl(ROWS), "application/jsonl")},
            headers=auth(key),
        )
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def create(self, key: str, base_model: str, **kw: Any) -> httpx.Response:
        body: dict[str, Any] = {
            "type": "sft",
            "base_model": base_model,
            "dataset": self.upload(key),
            "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            "max_tokens_per_pack": 256,
            "hyperparameters": {"max_steps": 2, "learning_rate": 1e-2},
        }
        body.update(kw)
        return httpx.post(f"{self.base}/v1/jobs", json=body, headers=auth(key), timeout=120)


@pytest.fixture()
def stack(
    tandem_env: Path,
    tiny_model_path: Path,
    key_store: KeyStore,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> Iterator[Stack]:
    from services.inference.app import create_app as create_inference
    from services.inference.config import InferenceSettings

    monkeypatch.setenv("TANDEM_MODEL_ROOTS", f"{tiny_model_path.parent}:{tandem_env / 'models'}")
    monkeypatch.setenv("TANDEM_SERVICE_API_KEY", key_store.create("system", "service", operator=True)[0])
    inference = create_inference(
        CommonSettings(),
        InferenceSettings(
            model=str(tiny_model_path), served_model_name="tiny", max_model_len=256, max_lora_rank=8
        ),
    )
    with serve_app(inference) as inf_url:
        monkeypatch.setenv("TANDEM_INFERENCE_URL", inf_url)
        app = create_app(CommonSettings(), TrainerSettings(heartbeat_interval_s=0.2))
        with serve_app(app) as base:
            yield Stack(base, app, inf_url)
        # the session's Valkey is shared with other modules: leave no published models behind
        for name in key_store.r.smembers("tandem:models:names"):  # type: ignore[union-attr]
            key_store.r.delete(f"tandem:models:{name}")
            key_store.r.srem("tandem:models:names", name)


def _adapter_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def test_job_from_own_adapter_trains_it_further_and_publishes_for_the_tenant(
    stack: Stack, api_key: str, other_key: str, tiny_model_path: Path, tandem_env: Path
) -> None:
    first = stack.create(api_key, str(tiny_model_path), publish=True)
    assert first.status_code == 201, first.text
    job1 = stack.run(first.json()["id"])
    assert job1["status"] == "succeeded", job1.get("error")
    ft1 = job1["fine_tuned_model"]
    assert ft1.startswith("ft-") and job1["published"] == "1"

    # published for acme only
    inf = stack.inference
    assert inf is not None
    mine = {m["id"]: m for m in httpx.get(f"{inf}/v1/models", headers=auth(api_key)).json()["data"]}
    assert mine[ft1]["owned_by"] == "acme" and mine[ft1]["kind"] == "adapter"
    assert ft1 not in {m["id"] for m in httpx.get(f"{inf}/v1/models", headers=auth(other_key)).json()["data"]}
    assert _chat_status(inf, api_key, ft1, "Count to 3.") == 200
    assert _chat_status(inf, other_key, ft1, "Count to 3.") == 404

    # another tenant can name it neither by name nor by path; an unknown ft- name reads the same
    for foreign in (
        ft1,
        "ft-0123456789abcdef",
        job1["artifact_path"],
        f"{tandem_env}/models/trainer/{first.json()['id']}/../{first.json()['id']}",
    ):
        r = stack.create(other_key, foreign)
        assert r.status_code == 404, (foreign, r.text)
        assert r.json()["error"]["param"] == "base_model"

    # nor as a reward model of an RL job
    r = stack.create(other_key, str(tiny_model_path), type="grpo", reward={"model": job1["artifact_path"]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "reward.model", r.text

    # a second round from the adapter: lr so small that the new adapter starts (and stays)
    # where the first ended, which a fresh LoRA (B = 0) would not
    second = stack.create(
        api_key,
        ft1,
        lora={"alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        hyperparameters={"max_steps": 1, "learning_rate": 1e-12},
        publish=True,
    )
    assert second.status_code == 201, second.text
    job2 = stack.run(second.json()["id"])
    assert job2["status"] == "succeeded", job2.get("error")
    ft2 = job2["fine_tuned_model"]
    assert job2["model_path"] == job1["model_path"]  # the same base model
    w1, w2 = _adapter_weights(Path(job1["artifact_path"])), _adapter_weights(Path(job2["artifact_path"]))
    assert set(w1) == set(w2)
    assert any(float(t.abs().max()) > 1e-4 for n, t in w1.items() if "lora_B" in n)
    for name, t in w1.items():
        torch.testing.assert_close(w2[name], t, atol=1e-6, rtol=0)
    cfg = json.loads((Path(job2["artifact_path"]) / "adapter_config.json").read_text())
    assert cfg["r"] == 4
    logs = httpx.get(f"{stack.base}/v1/jobs/{second.json()['id']}/logs", headers=auth(api_key)).json()["data"]
    assert any("LoRA initialised from" in x["message"] for x in logs)
    mine = {m["id"]: m for m in httpx.get(f"{inf}/v1/models", headers=auth(api_key)).json()["data"]}
    assert mine[ft2]["parent"] == "tiny" and mine[ft2]["owned_by"] == "acme"
    assert _chat_status(inf, api_key, ft2, "Count to 3.") == 200

    # by path too (one's own job's final weights), but not its checkpoints or the root
    own_path = stack.create(api_key, job1["artifact_path"])
    assert own_path.status_code == 201, own_path.text
    for bad in (f"{tandem_env}/models/trainer", f"{job1['artifact_path']}/adapter_model.safetensors"):
        r = stack.create(api_key, bad)
        assert r.status_code == 404 and r.json()["error"]["param"] == "base_model", r.text
    # the new adapter starts from the old one's weights: its rank is fixed
    r = stack.create(api_key, ft1, lora={"r": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora.r"
    r = stack.create(api_key, ft1, lora=None)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora"


def test_publish_is_checked_against_the_inference_capabilities(
    stack: Stack, api_key: str, tiny_model_path: Path
) -> None:
    r = stack.create(api_key, str(tiny_model_path), lora={"r": 16}, publish=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora.r"
    assert "max_lora_rank 8" in r.json()["error"]["message"]
    # the same rank without publishing is fine: the limit is the server's, not training's
    assert stack.create(api_key, str(tiny_model_path), lora={"r": 16}).status_code == 201
    # TANDEM_INFERENCE_URLS (used instead of TANDEM_INFERENCE_URL): a dead replica is passed over
    dead = f"http://127.0.0.1:{free_port()}"
    both = {"inference_urls": f"{stack.inference},{dead}", "inference_url": dead}
    stack.st.common = stack.st.common.model_copy(update=both)
    assert stack.create(api_key, str(tiny_model_path), publish=True).status_code == 201
    stack.st.common = stack.st.common.model_copy(update={"inference_urls": ""})
    r = stack.create(api_key, str(tiny_model_path), publish=True)
    assert r.status_code == 503 and r.json()["error"]["param"] == "publish"
    assert "unreachable" in r.json()["error"]["message"]


def test_full_fine_tune_lineage_and_an_adapter_published_on_it(
    stack: Stack, api_key: str, other_key: str, tiny_model_path: Path
) -> None:
    inf = stack.inference
    assert inf is not None
    full = stack.create(api_key, str(tiny_model_path), lora=None, publish=True)
    assert full.status_code == 201, full.text
    job = stack.run(full.json()["id"])
    assert job["status"] == "succeeded", job.get("error")
    ft_full = job["fine_tuned_model"]

    # a full fine-tune from it trains from its folder
    again = stack.create(api_key, ft_full, lora=None)
    assert again.status_code == 201, again.text
    assert stack.st.store.job(again.json()["id"])["model_path"] == job["artifact_path"]
    assert stack.create(other_key, ft_full, lora=None).status_code == 404

    # an adapter trained on it is published onto it (not onto the served base model)
    on_it = stack.create(api_key, ft_full, publish=True)
    assert on_it.status_code == 201, on_it.text
    ljob = stack.run(on_it.json()["id"])
    assert ljob["status"] == "succeeded", ljob.get("error")
    ft_lora = ljob["fine_tuned_model"]
    mine = {m["id"]: m for m in httpx.get(f"{inf}/v1/models", headers=auth(api_key)).json()["data"]}
    assert mine[ft_full]["kind"] == "registered" and mine[ft_full]["owned_by"] == "acme"
    assert mine[ft_lora]["kind"] == "adapter" and mine[ft_lora]["parent"] == ft_full
    theirs = {m["id"] for m in httpx.get(f"{inf}/v1/models", headers=auth(other_key)).json()["data"]}
    assert not {ft_full, ft_lora} & theirs
    assert _chat_status(inf, api_key, ft_lora, "Count to 2.") == 200
    assert _chat_status(inf, other_key, ft_lora, "Count to 2.") == 404
