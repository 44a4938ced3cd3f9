"""An agent service over real HTTP, wired to test doubles of retrieval and inference."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from tests.helpers.servers import serve_app

CORPUS = {
    "geo": {
        "fr": ("France", "Paris is the capital of France. France is known for wine and cheese."),
        "de": ("Germany", "Berlin is the capital of Germany. Germany has many forests."),
        "eiffel": ("Eiffel Tower", "Cats sleep a lot. The Eiffel Tower stands in Paris. Dogs bark."),
    }
}


@dataclass
class Stack:
    url: str
    corpus: FakeCorpus
    model: ScriptedModel
    retrieval_url: str
    inference_url: str
    trainer: RecordingTrainer

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/v1/ws/chat"


@contextmanager
def agent_stack(
    redis_url: str,
    home: Path,
    model: ScriptedModel | None = None,
    trainer_url: str | None = None,
    **settings: Any,
) -> Iterator[Stack]:
    """``trainer_url``: a real trainer to use instead of the recording double."""
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
            trainer_url=t_url,
            log_json=False,
        )
        app = create_app(common, AgentSettings(**settings))
        url = stack.enter_context(serve_app(app))
        yield Stack(url, corpus, model, r_url, i_url, trainer)
