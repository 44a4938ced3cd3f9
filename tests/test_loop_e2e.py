"""The learning loop end to end, through the public APIs, with the real SmolLM2-135M.

A collection of invented facts, questions asked through ``chat-documents-generate`` (the model writes each answer), thumbs and
corrections given, "train on feedback" (a LoRA ``kto`` job run by a real Celery worker and
published for the tenant), chat with the adapter through the agent; then the inference
service is restarted (a new app over the same Redis and model storage, nothing published
again) and the adapter still answers. Another tenant can neither see nor use it.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.cli.factset import make_facts
from services.common.auth import KeyStore
from services.common.config import CommonSettings
from tests.conftest import REPO_ROOT, auth
from tests.helpers.servers import celery_worker, free_port, serve_app
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.e2e

FACTS = make_facts(6, seed=5)
BASE = "SmolLM2-135M-Instruct"


def inference_app(common: CommonSettings, model: Path) -> Any:
    from services.inference.app import create_app
    from services.inference.config import InferenceSettings

    return create_app(common, InferenceSettings(model=str(model), served_model_name=BASE, max_batch_size=8))


def ask(agent: str, key: str, question: str, llm: str | None = None) -> httpx.Response:
    body: dict[str, Any] = {"query": question, "collection": "facts"}
    if llm:
        body["llm"] = llm
    return httpx.post(
        f"{agent}/v1/pipelines/chat-documents-generate/run", json=body, headers=auth(key), timeout=300
    )


def test_feedback_trains_an_adapter_that_serves_the_chat_after_a_restart(
    redis_url: str,
    tmp_path: Path,
    smollm2_path: Path,
    key_store: KeyStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.agent.app import create_app as create_agent
    from services.agent.config import AgentSettings
    from services.retrieval.app import create_app as create_retrieval
    from services.retrieval.config import RetrievalSettings
    from services.trainer.app import create_app as create_trainer
    from services.trainer.config import TrainerSettings

    home = tmp_path / "home"
    key = key_store.create("loop-acme")[0]
    other = key_store.create("loop-globex")[0]
    service_key = key_store.create("system", "service", operator=True)[0]
    inf_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(
        TANDEM_HOME=str(home),
        TANDEM_REDIS_URL=redis_url,
        TANDEM_MODEL_ROOTS=f"{smollm2_path.parent}:{home / 'models'}",
        TANDEM_SERVICE_API_KEY=service_key,
        TANDEM_INFERENCE_URL=f"http://127.0.0.1:{inf_port}",
        TANDEM_LOG_JSON="false",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(REPO_ROOT),
    )
    for name in list(os.environ):
        if name.startswith("TANDEM_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("TANDEM_"):
            monkeypatch.setenv(name, value)
    common = CommonSettings()
    log = tmp_path / "worker.log"

    with ExitStack() as stack:
        r_url = stack.enter_context(serve_app(create_retrieval(common, RetrievalSettings())))
        wait_until(lambda: httpx.get(f"{r_url}/readyz").status_code == 200, 300, "retrieval")
        inference = ExitStack()
        inference.enter_context(serve_app(inference_app(common, smollm2_path), port=inf_port))
        stack.callback(inference.close)
        i_url = f"http://127.0.0.1:{inf_port}"
        common = common.model_copy(update={"retrieval_url": r_url, "inference_url": i_url})
        t_url = stack.enter_context(serve_app(create_trainer(common, TrainerSettings())))
        common = common.model_copy(update={"trainer_url": t_url})
        # every rated answer trains (the promotion gate's holdout is tests/agent/test_promotions.py's)
        agent_settings = AgentSettings(
            tokenizer=str(smollm2_path), max_answer_tokens=40, promotion_holdout=0.0
        )
        agent = stack.enter_context(serve_app(create_agent(common, agent_settings)))
        stack.enter_context(celery_worker(env, log, "loop"))

        with httpx.Client(base_url=r_url, headers=auth(key), timeout=300) as client:
            assert client.post("/v1/collections", json={"name": "facts"}).status_code == 201
            docs = [{"id": f.fact_id, "title": f.title, "text": f.text} for f in FACTS]
            added = client.post("/v1/collections/facts/documents", json={"documents": docs})
            assert added.status_code == 201, added.text

        # 1. Questions asked; every answer recorded with the exact prompt it came from.
        answers = []
        for fact in FACTS:
            resp = ask(agent, key, fact.question)
            assert resp.status_code == 200, resp.text
            answers.append(resp.json())
        for fact, out in zip(FACTS, answers, strict=True):
            record = httpx.get(f"{agent}/v1/messages/{out['message_id']}", headers=auth(key)).json()
            assert record["model"] == BASE and record["completion"]
            assert fact.question in record["prompt"][-1]["content"]

        # 2. Feedback: a thumbs up, thumbs down, and corrections that cite the source's number.
        for i, (fact, out) in enumerate(zip(FACTS, answers, strict=True)):
            body: dict[str, Any] = {"message_id": out["message_id"], "rating": 1 if i % 3 == 0 else -1}
            if i % 3 == 1:
                body["correction"] = f"{fact.sentence} [1]"
            resp = httpx.post(f"{agent}/v1/feedback", json=body, headers=auth(key))
            assert resp.status_code == 200, resp.text
        foreign = {"message_id": answers[0]["message_id"], "rating": 1}
        assert httpx.post(f"{agent}/v1/feedback", json=foreign, headers=auth(other)).status_code == 404

        # 3. Train on feedback: a LoRA KTO job, published for this tenant.
        started = httpx.post(
            f"{agent}/v1/feedback/train",
            json={"format": "kto", "hyperparameters": {"max_steps": 2}},
            headers=auth(key),
            timeout=300,
        )
        assert started.status_code == 200, started.text
        out = started.json()
        assert out["dataset"]["rows"] >= 6 and out["job"]["type"] == "kto"
        job_id = out["job"]["id"]

        def finished() -> dict[str, Any] | None:
            job: dict[str, Any] = httpx.get(f"{t_url}/v1/jobs/{job_id}", headers=auth(key)).json()
            return job if job["status"] in ("succeeded", "failed", "cancelled") else None

        job = wait_until(finished, 900, "the kto job", log=log)
        assert job["status"] == "succeeded", (job["error"], log.read_text()[-3000:])
        adapter = job["fine_tuned_model"]
        assert job["published"] and adapter

        def models(k: str) -> set[str]:
            return {m["id"] for m in httpx.get(f"{i_url}/v1/models", headers=auth(k)).json()["data"]}

        assert adapter in models(key) and adapter not in models(other)

        # 4. The chat answers with the adapter, before and after a restart of the inference service.
        for restart in (False, True):
            if restart:
                inference.close()
                inference = ExitStack()
                inference.enter_context(serve_app(inference_app(common, smollm2_path), port=inf_port))
                stack.callback(inference.close)
            resp = ask(agent, key, FACTS[0].question, llm=adapter)
            assert resp.status_code == 200, resp.text
            record = httpx.get(f"{agent}/v1/messages/{resp.json()['message_id']}", headers=auth(key)).json()
            assert record["model"] == adapter and record["completion"]
        refused = ask(agent, other, FACTS[0].question, llm=adapter)
        assert refused.status_code == 404 and refused.json()["error"]["param"] == "llm"
