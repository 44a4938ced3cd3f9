"""Readiness and streams tell the truth about the engine loop: a real server on the torch engine
(a tiny model), whose runner's forward is replaced by a test double that blocks or fails, and
whose scheduler reads a clock the test moves (no test waits out the stall bound)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from services.common.config import CommonSettings
from services.inference.app import create_app
from services.inference.config import InferenceSettings
from services.inference.engine import TorchEngine
from tests.conftest import auth
from tests.helpers.servers import serve_app
from tests.helpers.waiting import ManualClock

STALL_S = 5.0
ASK = [{"role": "user", "content": "Say something."}]


class DeviceLost(BaseException):
    """A failure no step survives (it is not an ``Exception``): the loop thread ends with it."""


@dataclass
class Forward:
    """The runner's forward, with a switch: ``block`` holds the next forward until ``release``
    is set; ``fail`` makes every forward raise it (the model's forward failing on the device)."""

    real: Callable[..., Any]
    block: bool = False
    fail: BaseException | None = None
    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def __call__(self, *args: Any) -> Any:
        if self.fail is not None:
            raise self.fail
        if self.block:
            self.block = False
            self.entered.set()
            assert self.release.wait(60), "the test never released the forward"
        return self.real(*args)


@dataclass
class Served:
    url: str
    key: str
    clock: ManualClock
    forward: Forward
    client: openai.OpenAI

    def readyz(self) -> httpx.Response:
        return httpx.get(f"{self.url}/readyz", headers=auth(self.key), timeout=30)

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", headers=auth(self.key), timeout=30)


@pytest.fixture
def served(tmp_path: Path, redis_url: str, tiny_model_path: Path, key: str) -> Iterator[Served]:
    engine = TorchEngine.from_pretrained(
        tiny_model_path,
        name="tiny",
        max_batch_size=2,
        prefix_cache_mb=0,
        admit_window=0,  # no admission window: the manual clock is the heartbeat's alone
        stall_after=STALL_S,
    )
    clock = ManualClock()
    engine.scheduler.clock = clock
    forward = Forward(engine.runner.forward)
    engine.runner.forward = forward  # type: ignore[method-assign]
    common = CommonSettings(home=tmp_path, redis_url=redis_url, log_json=False)
    app = create_app(common, InferenceSettings(model=str(tiny_model_path)), engine=engine)
    with serve_app(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
        yield Served(url, key, clock, forward, client)


def _stream_chat(client: openai.OpenAI, out: list[Any]) -> None:
    for chunk in client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, stream=True):  # type: ignore[arg-type]
        out.append(chunk)


def test_a_stuck_engine_loop_fails_readiness_until_it_steps_again(served: Served) -> None:
    # idle for long: a request arriving now has not waited, whatever the last step's age
    served.clock.t = 100.0
    assert served.readyz().status_code == 200
    served.forward.block = True
    chunks: list[Any] = []
    request = threading.Thread(target=_stream_chat, args=(served.client, chunks))
    request.start()
    assert served.forward.entered.wait(60), "the request never reached the forward"
    assert served.readyz().status_code == 200  # in a step, but not for long yet
    served.clock.t = 100.0 + STALL_S + 1
    ready = served.readyz()
    assert ready.status_code == 503
    reason = ready.json()["checks"]["engine"]
    assert "the engine loop has not completed a step for 6 s while 1 request waits" in reason
    health = served.health()
    assert health.status_code == 503
    assert "has not completed a step for 6 s" in health.json()["error"]["message"]
    # liveness stays cheap: the process is alive, only readiness asks the loop
    assert httpx.get(f"{served.url}/healthz", timeout=30).status_code == 200

    served.forward.release.set()
    request.join(120)
    assert not request.is_alive()
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert served.readyz().status_code == 200
    detail = served.health().json()
    assert detail["steps"] >= 1 and detail["waiting"] == 0 and detail["last_step_s"] == 0


def test_a_failed_forward_ends_every_streaming_route_with_an_error_event(served: Served) -> None:
    served.forward.fail = RuntimeError("device fault")
    client = served.client
    with pytest.raises(openai.APIError, match="generation failed: RuntimeError: device fault"):
        _stream_chat(client, [])
    with pytest.raises(openai.APIError, match="generation failed: RuntimeError: device fault"):
        for _ in client.completions.create(model="tiny", prompt="Once", max_tokens=4, stream=True):
            pass
    events = list(client.responses.create(model="tiny", input="Say something.", stream=True))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.failed"
    failed = events[-1].response  # type: ignore[union-attr]
    assert (
        failed.error is not None and "generation failed: RuntimeError: device fault" in failed.error.message
    )

    # the loop survived the failure: still ready, and it serves once the device works again
    assert served.readyz().status_code == 200
    served.forward.fail = None
    chunks: list[Any] = []
    _stream_chat(client, chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_dead_engine_loop_ends_open_streams_with_an_error_and_fails_readiness(served: Served) -> None:
    served.forward.fail = DeviceLost("the accelerator fell off the bus")
    with pytest.raises(openai.APIError, match="the engine loop died: DeviceLost: the accelerator fell off"):
        _stream_chat(served.client, [])

    ready = served.readyz()
    assert ready.status_code == 503
    assert "the engine loop died: DeviceLost" in ready.json()["checks"]["engine"]
    health = served.health()
    assert health.status_code == 503
    assert "the engine loop died: DeviceLost" in health.json()["error"]["message"]
    # nothing would run a new request: it is refused at once, never left waiting forever
    with pytest.raises(openai.InternalServerError, match="the engine loop died") as refused:
        served.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2)  # type: ignore[arg-type]
    assert refused.value.status_code == 503


def _sse_frames(events: Any) -> list[str]:
    """What ``serving._stream`` sends for an engine stream of text completions."""
    import asyncio

    from services.common.openai_wire import CompletionChoice, TextCompletion
    from services.inference.engine import SamplingParams
    from services.inference.serving import OpenAIServing, _Chunks, _stream

    async def run() -> list[str]:
        chunks = _Chunks[CompletionChoice](TextCompletion, "cmpl-x", 0, "tiny", include_usage=True)
        step = OpenAIServing._completion_step(SamplingParams())
        return [frame async for frame in _stream(events, 1, 1, chunks, step)]

    return asyncio.run(run())


@pytest.mark.parametrize("how", ["raises", "ends early"])
def test_an_engine_stream_that_breaks_ends_with_an_error_event_not_a_cut(how: str) -> None:
    from services.inference.engine.types import StreamEvent

    async def events() -> Any:
        yield StreamEvent(0, [1], "Once", None, None, 3, 1)
        if how == "raises":
            raise RuntimeError("the engine's queue is gone")

    frames = _sse_frames(events())
    assert frames[-1] == "data: [DONE]\n\n"
    error = json.loads(frames[-2].removeprefix("data: "))["error"]
    expected = (
        "generation failed: RuntimeError: the engine's queue is gone"
        if how == "raises"
        else "the engine's stream ended before the answer was complete"
    )
    assert error["message"] == expected and error["type"] == "internal_error"
    # no usage chunk: it would read as the end of a whole answer
    assert not any('"usage"' in f and '"choices": []' in f for f in frames)
