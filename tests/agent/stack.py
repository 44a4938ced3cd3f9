"""An agent service over real HTTP, wired to test doubles of retrieval and inference
(``agent_stack``), or to the real retrieval and inference services (``real_services``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from services.agent.app import create_app
from services.agent.config import AgentSettings
from services.common.config import CommonSettings
from tests.agent.doubles import (
    FakeCorpus,
    RecordingTrainer,
    ScriptedModel,
    inference_double,
    retrieval_double,
    trainer_double,
)
from tests.conftest import auth
from tests.helpers.servers import serve_app, wait_ready

CORPUS = {
    "geo": {
        "fr": ("France", "Paris is the capital of France. France is known for wine and cheese."),
        "de": ("Germany", "Berlin is the capital of Germany. Germany has many forests."),
        "eiffel": ("Eiffel Tower", "Cats sleep a lot. The Eiffel Tower stands in Paris. Dogs bark."),
    }
}


def chat_socket(agent_url: str) -> str:
    """The agent's websocket chat URL."""
    return agent_url.replace("http://", "ws://") + "/v1/ws/chat"


@dataclass
class Stack:
    url: str
    corpus: FakeCorpus
    model: ScriptedModel
    retrieval_url: str
    inference_url: str
    trainer: RecordingTrainer
    app: Any = None  # the agent's FastAPI app (its state: the runtime, the metrics registry)

    @property
    def ws_url(self) -> str:
        return chat_socket(self.url)


@contextmanager
def agent_stack(
    redis_url: str,
    home: Path,
    model: ScriptedModel | None = None,
    trainer_url: str | None = None,
    inference_urls: str = "",
    service_key: str = "",
    **settings: Any,
) -> Iterator[Stack]:
    """``trainer_url``: a real trainer to use instead of the recording double; ``inference_urls``:
    TANDEM_INFERENCE_URLS (replicas used instead of the double); ``service_key``: the agent's
    TANDEM_SERVICE_API_KEY (an operator key)."""
    corpus = FakeCorpus({k: dict(v) for k, v in CORPUS.items()})
    model = model or ScriptedModel()
    trainer = RecordingTrainer()
    with ExitStack() as stack:
        r_url = stack.enter_context(serve_app(retrieval_double(corpus)))
        i_url = stack.enter_context(serve_app(inference_double(model)))
        t_url = trainer_url or stack.enter_context(serve_app(trainer_double(trainer)))
        common = CommonSettings(
            home=home,
            redis_url=redis_url,
            retrieval_url=r_url,
            inference_url=i_url,
            inference_urls=inference_urls,
            trainer_url=t_url,
            service_api_key=service_key,
            log_json=False,
        )
        app = create_app(common, AgentSettings(**settings))
        url = stack.enter_context(serve_app(app))
        yield Stack(url, corpus, model, r_url, i_url, trainer, app)


@dataclass
class RealStack:
    agent: str
    retrieval: str
    inference: str
    key: str
    collection: str = "facts"

    def run(self, pipeline: str, body: dict[str, Any]) -> httpx.Response:
        """A pipeline run through the agent's JSON route; fails the test on anything but 200."""
        resp = httpx.post(
            f"{self.agent}/v1/pipelines/{pipeline}/run", json=body, headers=auth(self.key), timeout=300
        )
        assert resp.status_code == 200, resp.text
        return resp

    ws = property(lambda self: chat_socket(self.agent))


def new_key(redis_url: str, tenant: str) -> str:
    """A new API key of ``tenant``."""
    from services.common.auth import KeyStore
    from services.common.redis_conn import sync_redis

    return str(KeyStore(sync_redis(redis_url)).create(tenant)[0])


@contextmanager
def real_services(
    redis_url: str,
    home: Path,
    model: Path,
    key: str,
    documents: list[dict[str, Any]],
    inference: dict[str, Any] | None = None,
    **settings: Any,
) -> Iterator[RealStack]:
    """The agent over the real retrieval service (its offline default embedder) and the real
    inference service on ``model`` (``inference``: its settings), in-process over real HTTP, with
    ``documents`` in the collection ``facts`` of ``key``'s tenant. ``settings``: the agent's."""
    from services.inference.app import create_app as create_inference
    from services.inference.config import InferenceSettings
    from services.retrieval.app import create_app as create_retrieval
    from services.retrieval.config import RetrievalSettings

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with ExitStack() as stack:
        base = CommonSettings(
            home=home, redis_url=redis_url, log_json=False, model_roots=f"{home}:{model.parent}"
        )
        r_url = stack.enter_context(serve_app(create_retrieval(base, RetrievalSettings())))
        # transformers' lazy imports are not thread-safe: let the embedder finish loading in its
        # thread before the inference app loads the model in another.
        wait_ready(r_url)
        i_app = create_inference(base, InferenceSettings(model=str(model), **(inference or {})))
        i_url = stack.enter_context(serve_app(i_app))
        common = base.model_copy(update={"retrieval_url": r_url, "inference_url": i_url})
        a_url = stack.enter_context(serve_app(create_app(common, AgentSettings(**settings))))
        with httpx.Client(base_url=r_url, headers=auth(key), timeout=300) as client:
            assert client.post("/v1/collections", json={"name": "facts"}).status_code == 201
            resp = client.post("/v1/collections/facts/documents", json={"documents": documents})
            assert resp.status_code == 201, resp.text
        yield RealStack(a_url, r_url, i_url, key)
