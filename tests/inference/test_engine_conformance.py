"""The ``Engine`` protocol's contract, run against every implementation: the torch engine in
process, the remote engine forwarding to a second Tandem inference service, and vLLM where it
is installed. Each answers greedy requests with the same tokens, lists and serves its models,
and reports adapter mistakes as the typed errors the API maps to 404 and 409."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.inference.engine.base import AdapterNotFound, Engine, NameTaken
from services.inference.engine.types import EngineRequest, SamplingParams
from tests.helpers.models import greedy_reference
from tests.inference.test_adapters_remote import adapters, home, key, server  # noqa: F401 (fixtures)

PROMPT = "The conformance of engines"
N = 8


@pytest.fixture(scope="module", params=["torch", "remote", "vllm"])
def make_engine(request: pytest.FixtureRequest, lively_tiny_path: Path) -> Iterator[Any]:
    """A factory of a fresh, started engine of each kind serving the tiny model as ``tiny``."""
    kind = request.param
    if kind == "vllm":
        pytest.importorskip("vllm", reason="vllm is not installed here (it ships in the GPU image)")

    def make() -> Engine:
        if kind == "torch":
            from services.inference.engine.torch_engine import TorchEngine

            return TorchEngine.from_pretrained(lively_tiny_path, name="tiny", max_batch_size=2)
        if kind == "remote":
            from services.inference.engine.remote import RemoteEngine

            url, _ = request.getfixturevalue("server")
            return RemoteEngine(url, api_key=request.getfixturevalue("key"))
        from services.inference.engine.vllm_engine import VLLMEngine  # pragma: no cover (GPU images)

        return VLLMEngine.from_pretrained(lively_tiny_path, name="tiny")  # type: ignore[attr-defined]

    yield make


def run(make: Any, body: Any) -> Any:
    async def go() -> Any:
        engine = make()
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(go())


async def collect(events: AsyncIterator[Any]) -> tuple[str, str | None, int]:
    text, finish, tokens = [], None, 0
    async for ev in events:
        assert ev.error is None, ev.error
        text.append(ev.text)
        finish = ev.finish_reason or finish
        tokens = ev.completion_tokens or tokens
    return "".join(text), finish, tokens


def test_greedy_generation_is_the_reference_on_every_engine(make_engine: Any, lively_tiny_path: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)

    async def body(engine: Engine) -> tuple[str, str | None, int]:
        req = EngineRequest(request_id=uuid.uuid4().hex, params=params, model="tiny", prompt=PROMPT)
        return await collect(await engine.generate(req))

    text, finish, tokens = run(make_engine, body)
    assert text == greedy_reference(lively_tiny_path, None, PROMPT, N)
    assert finish == "length" and tokens == N


def test_every_engine_lists_and_serves_its_model(make_engine: Any) -> None:
    async def body(engine: Engine) -> tuple[list[str], bool]:
        names = [m.id for m in await engine.models()]
        return names, engine.serves("tiny")

    # (an unknown name: the torch engine says no at once, the remote one lets its upstream
    # answer 404, so the protocol does not fix serves() for it)
    names, serves = run(make_engine, body)
    assert "tiny" in names and serves


def test_adapter_mistakes_are_typed_errors_on_every_engine(
    make_engine: Any,
    adapters: dict[str, Path],  # noqa: F811 (the fixture imported above)
) -> None:
    name = f"conf-{uuid.uuid4().hex[:6]}"

    async def body(engine: Engine) -> None:
        with pytest.raises(AdapterNotFound):
            await engine.unload_adapter("never-loaded")
        await engine.load_adapter(name, str(adapters["a1"]))
        try:
            assert engine.serves(name) or name in [m.id for m in await engine.models()]
            with pytest.raises(NameTaken):
                await engine.load_adapter(name, str(adapters["a2"]))
        finally:
            await engine.unload_adapter(name)
        with pytest.raises(AdapterNotFound):
            await engine.unload_adapter(name)

    run(make_engine, body)


def test_aborting_an_unknown_request_is_quiet_on_every_engine(make_engine: Any) -> None:
    async def body(engine: Engine) -> None:
        await engine.abort("no-such-request")

    run(make_engine, body)
