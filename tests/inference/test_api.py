"""The HTTP API through the official ``openai`` client and LangChain's ``ChatOpenAI``,
against a real server (uvicorn on a free port) running the torch engine on a tiny model."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from services.common.config import CommonSettings
from services.inference.app import create_app
from services.inference.config import InferenceSettings
from tests.helpers.servers import serve_app
from tests.helpers.waiting import wait_until

MAX_LEN = 256


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("inference-home")


def _common(home: Path, redis_url: str) -> CommonSettings:
    return CommonSettings(home=home, redis_url=redis_url, model_roots=str(home / "models"), log_json=False)


@pytest.fixture(scope="module")
def server(home: Path, redis_url: str, lively_tiny_path: Path) -> Iterator[tuple[str, Any]]:
    settings = InferenceSettings(
        model=str(lively_tiny_path),
        served_model_name="tiny",
        max_model_len=MAX_LEN,
        max_batch_size=4,
        max_queue=8,
    )
    app = create_app(_common(home, redis_url), settings)
    with serve_app(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def client(server: tuple[str, Any], key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=key, max_retries=0, timeout=120)


def _greedy(**extra: Any) -> dict[str, Any]:
    return {"temperature": 0, **extra}


def test_models_chat_and_completions(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny", "all-MiniLM-L6-v2"]  # the chat model, then the default embedding model
    assert client.models.retrieve("tiny").id == "tiny"

    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=12, **_greedy()
    )
    assert chat.object == "chat.completion"
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert chat.usage is not None and chat.usage.completion_tokens <= 12
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    # streaming gives the same text, chunk by chunk, usage last
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **_greedy(),
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    comp = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=10, logprobs=2, **_greedy()
    )
    assert comp.object == "text_completion"
    lp = comp.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == comp.usage.completion_tokens
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == comp.choices[0].text or comp.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=10, stream=True, **_greedy()
        )
    )
    assert streamed == comp.choices[0].text


def test_sampling_seed_n_and_chat_logprobs(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Pick words"}],
        "max_tokens": 16,
    }
    a = client.chat.completions.create(**args, temperature=1.0, top_p=0.95, seed=5, n=3)
    b = client.chat.completions.create(**args, temperature=1.0, top_p=0.95, seed=5, n=3)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1
    assert [c.index for c in a.choices] == [0, 1, 2]
    with_lp = client.chat.completions.create(**args, temperature=0, logprobs=True, top_logprobs=3)
    content = with_lp.choices[0].logprobs.content
    assert len(content) == with_lp.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)
    # top_k=1 through extra_body is greedy
    greedy = client.chat.completions.create(**args, temperature=0)
    topk1 = client.chat.completions.create(**args, temperature=1.0, seed=1, extra_body={"top_k": 1})
    assert topk1.choices[0].message.content == greedy.choices[0].message.content
    stopped = client.chat.completions.create(
        **args, temperature=0, stop=[greedy.choices[0].message.content[3:6]]
    )
    if greedy.choices[0].message.content[3:6]:
        assert stopped.choices[0].finish_reason == "stop"
        assert len(stopped.choices[0].message.content) <= 3 + 2


def test_errors_are_openai_shaped_and_service_keeps_serving(
    client: openai.OpenAI, server: tuple[str, Any], key: str
) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert nf.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert "nope" in nf.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as long:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 400}])
    assert f"maximum context length is {MAX_LEN}" in long.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as too_many:
        client.completions.create(model="tiny", prompt="hi", max_tokens=MAX_LEN * 2)
    assert str(MAX_LEN) in too_many.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as temp:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], temperature=7
        )
    assert "temperature" in temp.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], frequency_penalty=3
        )
    url = server[0]
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    bad = httpx.post(
        url + "/v1/chat/completions", content=b'{"model": "tiny", "messages": [', headers=headers
    )
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
    noauth = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert noauth.status_code == 401
    ok = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3
    )
    assert ok.choices[0].message.content is not None


def test_langchain_chat_openai(server: tuple[str, Any], key: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=server[0] + "/v1", api_key=key, model="tiny", temperature=0, max_tokens=8, max_retries=0
    )
    reply = llm.invoke("Say something")
    assert isinstance(reply.content, str)
    pieces = [c.content for c in llm.stream("Say something")]
    assert "".join(str(p) for p in pieces) == reply.content
    assert reply.usage_metadata is not None and reply.usage_metadata["output_tokens"] >= 1


def _chat_stream(url: str, key: str, body: dict[str, Any]) -> Any:
    """A streaming chat completion over raw HTTP (the SSE lines as the server writes them)."""
    return httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def _stream_chat(url: str, key: str, content: str, max_tokens: int, out: dict[str, Any]) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times, text = [], []
    with _chat_stream(url, key, body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    text.append(delta["content"])
                    times.append(time.monotonic())
    out["text"] = "".join(text)
    out["times"] = times


def test_request_joins_mid_generation_without_disturbing_others(
    client: openai.OpenAI, server: tuple[str, Any], key: str
) -> None:
    url = server[0]
    solo: dict[str, str] = {}
    for name, content, n in (("long", "Tell a long story", 200), ("short", "A short one", 20)):
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": content}],
            max_tokens=n,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        solo[name] = r.choices[0].message.content or ""
    long_out: dict[str, Any] = {}
    short_out: dict[str, Any] = {}
    t = threading.Thread(target=_stream_chat, args=(url, key, "Tell a long story", 200, long_out))
    t.start()
    engine = server[1].state.registry.primary

    def generated() -> int:
        slots = list(engine.scheduler.slots)
        return len(slots[0].output_ids) if slots and len(slots[0].output_ids) >= 5 else 0

    # start the short one once the long one is producing tokens
    progress = wait_until(generated, 60, "the long request generates", interval=0.002)
    _stream_chat(url, key, "A short one", 20, short_out)
    t.join(60)
    assert long_out["text"] == solo["long"]
    assert short_out["text"] == solo["short"]
    # the short request arrived when the long one was already generating, and finished while
    # the long one was still streaming: it joined the running batch
    assert 5 <= progress < 200
    assert short_out["times"][-1] < long_out["times"][-1]


def test_disconnect_mid_stream_frees_the_slot(
    home: Path, redis_url: str, lively_tiny_path: Path, key: str
) -> None:
    # Long enough (2048 positions, one token a step: no drafts) that the request still runs when
    # the client has read four events, however fast this machine decodes or slowly the client reads
    settings = InferenceSettings(
        model=str(lively_tiny_path), served_model_name="tiny", max_model_len=2048, prompt_lookup="off"
    )
    app = create_app(_common(home, redis_url), settings)
    with serve_app(app) as url:
        engine = app.state.registry.primary
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "go on forever"}],
            "max_tokens": 1800,
            "ignore_eos": True,
            "stream": True,
        }
        with _chat_stream(url, key, body) as r:
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 4:
                    break
            assert engine.scheduler.load()["running"] == 1
        wait_until(lambda: engine.scheduler.load() == {"running": 0, "waiting": 0}, 10, "the slot is freed")


def test_queue_full_is_429_with_retry_after(
    home: Path, redis_url: str, lively_tiny_path: Path, key: str
) -> None:
    settings = InferenceSettings(
        model=str(lively_tiny_path), served_model_name="tiny", max_batch_size=1, max_queue=0
    )
    app = create_app(_common(home, redis_url), settings)
    with serve_app(app) as url:
        out: dict[str, Any] = {}
        # Long enough (the tiny model holds 2048 positions) that the slot is still taken when
        # the second request arrives, however fast this machine decodes.
        t = threading.Thread(target=_stream_chat, args=(url, key, "occupy the slot", 1800, out))
        t.start()
        engine = app.state.registry.primary
        wait_until(lambda: engine.scheduler.load()["running"], 30, "the slot is taken", interval=0.01)
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.RateLimitError) as exc:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
        assert int(exc.value.response.headers["Retry-After"]) >= 1
        t.join(180)
        ok = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        assert ok.choices[0].message.content is not None


def test_timeout_ends_a_request(lively_tiny_path: Path) -> None:
    from services.inference.engine import EngineRequest, SamplingParams, TorchEngine

    engine = TorchEngine.from_pretrained(lively_tiny_path, max_batch_size=2)

    async def run() -> list[Any]:
        await engine.start()
        try:
            req = EngineRequest(
                "t1", SamplingParams(max_tokens=None, ignore_eos=True), prompt="x", timeout=0.3
            )
            return [ev async for ev in await engine.generate(req)]
        finally:
            await engine.shutdown()

    events = asyncio.run(run())
    assert events[-1].finish_reason == "timeout"
    assert events[-1].error == "the request timed out"
    assert 0 < events[-1].completion_tokens < 2000
