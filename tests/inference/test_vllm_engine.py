"""The vLLM engine, where vLLM is installed (the GPU image); skipped elsewhere."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.inference.engine.vllm_engine import vllm_available

pytestmark = pytest.mark.skipif(
    not vllm_available(),
    reason="vllm is not installed here (it ships in the GPU image: pip install '.[gpu]')",
)


def test_vllm_engine_generates_and_streams(smollm2_path: Path) -> None:
    from services.inference.engine import EngineRequest, SamplingParams
    from services.inference.engine.base import Engine
    from services.inference.engine.types import PromptMessage
    from services.inference.engine.vllm_engine import VLLMEngine

    engine = VLLMEngine(
        str(smollm2_path), name="smol", max_model_len=2048, max_num_seqs=8, gpu_memory_utilization=0.3
    )
    assert isinstance(engine, Engine)

    async def run() -> str:
        await engine.start()
        try:
            req = EngineRequest(
                "v1",
                SamplingParams(temperature=0, max_tokens=16),
                model="smol",
                messages=[PromptMessage("user", "What is the capital of France?")],
            )
            events = [ev async for ev in await engine.generate(req)]
            assert events[-1].finish_reason in ("stop", "length")
            return "".join(ev.text for ev in events)
        finally:
            await engine.shutdown()

    assert "Paris" in asyncio.run(run())


def test_vllm_engine_json_schema_output_validates(smollm2_path: Path) -> None:
    """response_format json_schema passes through to vLLM's own guided decoding."""
    import json

    import jsonschema

    from services.inference.engine import EngineRequest, SamplingParams
    from services.inference.engine.types import GuidedDecoding, PromptMessage
    from services.inference.engine.vllm_engine import VLLMEngine

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    engine = VLLMEngine(
        str(smollm2_path), name="smol", max_model_len=2048, max_num_seqs=8, gpu_memory_utilization=0.3
    )

    async def run() -> list[str]:
        await engine.start()
        try:
            params = SamplingParams(
                temperature=1.0,
                max_tokens=120,
                n=4,
                seed=1,
                guided=GuidedDecoding(json_schema=json.dumps(schema)),
            )
            req = EngineRequest("r", params, messages=[PromptMessage("user", "A person as JSON.")])
            texts: dict[int, str] = {}
            async for ev in await engine.generate(req):
                texts[ev.index] = texts.get(ev.index, "") + ev.text
            return list(texts.values())
        finally:
            await engine.shutdown()

    for text in asyncio.run(run()):
        jsonschema.validate(json.loads(text), schema)
