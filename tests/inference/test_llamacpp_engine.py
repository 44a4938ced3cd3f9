"""The llama.cpp engine (TANDEM_INFERENCE_ENGINE=llamacpp) on the real default GGUF file.

Needs ``llama_cpp`` (llama-cpp-python, the ``llamacpp`` extra: it has no wheel for every
platform, so CI does not build it); those tests skip where it cannot be imported. The
bad-configuration tests run everywhere.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from services.common.config import CommonSettings
from services.inference.config import InferenceSettings
from services.inference.engine import EngineRequest, SamplingParams
from services.inference.engine.types import AdapterError, GuidedDecoding, PromptMessage

HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
needs_llama = pytest.mark.skipif(
    not HAVE_LLAMA,
    reason="llama_cpp (llama-cpp-python) is not installed: pip install -e '.[llamacpp]' (it compiles llama.cpp)",
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _common(home: Path, redis_url: str = "redis://127.0.0.1:1/0") -> CommonSettings:
    return CommonSettings(home=home, redis_url=redis_url, model_roots=str(home / "models"), log_json=False)


# --- bad configuration stops start-up, naming what is wrong ----------------------------------------
def test_missing_llama_cpp_stops_start_up_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.inference.engine.llamacpp_engine import LlamaCppMissing
    from services.inference.engines import build_llamacpp_engine

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    with pytest.raises(LlamaCppMissing, match=r"llama_cpp.*llama-cpp-python"):
        build_llamacpp_engine(InferenceSettings(engine="llamacpp"), _common(tmp_path), "m")


def test_a_model_that_is_not_gguf_stops_start_up_naming_it(tmp_path: Path) -> None:
    from services.inference.engines import build_llamacpp_engine

    folder = tmp_path / "hf-model"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"TANDEM_INFERENCE_MODEL=.*hf-model.*not a \.gguf"):
        build_llamacpp_engine(InferenceSettings(engine="llamacpp", model=str(folder)), _common(tmp_path), "m")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match=r"fake\.gguf is not one"):
        build_llamacpp_engine(InferenceSettings(engine="llamacpp", model=str(fake)), _common(tmp_path), "m")


# --- the engine on the real GGUF -------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if not HAVE_LLAMA:
        pytest.skip("llama_cpp (llama-cpp-python) is not installed")
    from services.inference.engine.llamacpp_engine import LlamaCppEngine
    from services.inference.engine.loader import default_gguf_path

    eng = LlamaCppEngine(
        default_gguf_path(),
        name="smol",
        max_batch_size=4,
        max_model_len=512,
        threads=1,
        cache_root=tmp_path_factory.mktemp("llamacpp-cache"),
    )
    loop = asyncio.new_event_loop()
    loop.run_until_complete(eng.start())
    yield eng
    loop.run_until_complete(eng.shutdown())
    loop.close()


def _request(rid: str, messages: list[dict], model: str = "smol", **params: Any) -> EngineRequest:
    typed = [PromptMessage.from_openai(m, i) for i, m in enumerate(messages)]
    return EngineRequest(rid, SamplingParams(**{"temperature": 0, "max_tokens": 24, **params}), model, typed)


async def _tokens(engine: Any, req: EngineRequest) -> tuple[list[int], str, str | None]:
    ids: list[int] = []
    text, reason = "", None
    async for ev in await engine.generate(req):
        assert ev.error is None, ev.error
        ids += ev.token_ids
        text += ev.text
        reason = ev.finish_reason or reason
    return ids, text, reason


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


@needs_llama
def test_greedy_is_the_same_alone_twice_and_in_a_full_batch(engine: Any) -> None:
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain photosynthesis in one sentence.",
        "Name three primary colours.",
        "How do bees make honey?",
    ]
    msgs = [[{"role": "user", "content": q}] for q in questions]

    async def alone() -> list[tuple[list[int], str, str | None]]:
        return [await _tokens(engine, _request(f"a{i}", m)) for i, m in enumerate(msgs)]

    async def together() -> list[tuple[list[int], str, str | None]]:
        # five requests for four slots: a full batch, one joining as another leaves
        return list(
            await asyncio.gather(*(_tokens(engine, _request(f"b{i}", m)) for i, m in enumerate(msgs)))
        )

    first, second, batched = _run(alone()), _run(alone()), _run(together())
    assert first == second
    assert batched == first
    assert all(len(ids) >= 5 for ids, _, _ in first)  # real answers, not an instant end


@needs_llama
def test_stop_strings_max_tokens_and_seeded_sampling(engine: Any) -> None:
    _, full, _ = _run(_tokens(engine, _request("s0", QUESTION)))
    stop = full.split()[2]  # a word from the middle of the greedy answer
    _, cut, reason = _run(_tokens(engine, _request("s1", QUESTION, stop=[stop])))
    assert reason == "stop" and cut == full[: full.index(stop)]
    ids, _, reason = _run(_tokens(engine, _request("s2", QUESTION, max_tokens=3)))
    assert reason == "length" and len(ids) == 3
    # sampled: the same seed gives the same tokens, another seed (almost surely) others
    hot = {"temperature": 1.5, "top_p": 0.95, "max_tokens": 20}
    a = _run(_tokens(engine, _request("s3", QUESTION, seed=7, **hot)))[0]
    b = _run(_tokens(engine, _request("s4", QUESTION, seed=7, **hot)))[0]
    c = _run(_tokens(engine, _request("s5", QUESTION, seed=8, **hot)))[0]
    assert a == b and a != c


@needs_llama
def test_json_mode_output_is_json(engine: Any) -> None:
    guided = GuidedDecoding(json_schema=json.dumps({"type": "object"}))
    _, text, reason = _run(
        _tokens(
            engine,
            _request(
                "j0", [{"role": "user", "content": "Describe a cat as JSON."}], guided=guided, max_tokens=60
            ),
        )
    )
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a JSON prefix
        assert text.startswith("{")


# --- LoRA: PEFT adapters converted to GGUF at load ----------------------------------------------
@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random rank-8 LoRA on SmolLM2 (q/k/v/o, as the trainer's default) strong enough to
    change the greedy answer."""
    from tests.helpers.models import make_lora_adapter, smollm2_dir

    target = tmp_path_factory.mktemp("smol-lora")
    return make_lora_adapter(
        smollm2_dir(), target, 0, modules=["q_proj", "k_proj", "v_proj", "o_proj"], b_std=0.1
    )


def _llama_logits(engine: Any, ids: list[int], adapter: str | None) -> Any:
    """The engine's runner's logits at the prompt's last token (a free slot, between steps)."""
    from services.inference.engine.ragged import PrefillRow

    slot = engine.runner.max_slots - 1
    with engine.model_lock:
        try:
            return engine.runner.forward([], [PrefillRow(slot, ids, 0, adapter)])[0].numpy()
        finally:
            engine.runner.release(slot)


@needs_llama
def test_a_peft_adapter_applies_as_peft_does_and_mixes_with_the_base_in_a_batch(
    engine: Any, peft_adapter: Path
) -> None:
    """The converted adapter moves llama.cpp's logits as PEFT moves the torch model's (same
    de-quantised weights); base and adapter requests in one batch give what each gives alone."""
    import numpy as np
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.helpers.models import smollm2_dir

    engine.load_adapter_sync("smol-lora", str(peft_adapter))
    try:
        ids = engine.encode_chat(QUESTION)
        moved = _llama_logits(engine, ids, "smol-lora") - _llama_logits(engine, ids, None)
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32), str(peft_adapter)
        ).eval()
        with torch.no_grad():
            lora_ref = peft_model(torch.tensor([ids])).logits[0, -1].numpy()
            with peft_model.disable_adapter():
                base_ref = peft_model(torch.tensor([ids])).logits[0, -1].numpy()
        moved_ref = lora_ref - base_ref
        # Q4_1 weights in llama.cpp's kernels vs the same weights de-quantised to fp32 differ a
        # little; a wrong tensor name, scale or RoPE permutation would move the logits elsewhere
        assert np.abs(moved_ref).mean() > 0.5  # the adapter matters
        # (measured: 0.98 with llama.cpp's RoPE permutation of q/k B, below 0 without it)
        assert np.corrcoef(moved, moved_ref)[0, 1] > 0.9
        # a shift common to every token does not change the distribution: compare the rest
        moved, moved_ref = moved - moved.mean(), moved_ref - moved_ref.mean()
        slope = float(moved @ moved_ref / (moved_ref @ moved_ref))
        assert 0.5 < slope < 2, slope  # applied at PEFT's strength (the exact scale: the test below)

        base_ids = _run(_tokens(engine, _request("l0", QUESTION, max_tokens=12)))[0]
        lora_ids = _run(_tokens(engine, _request("l1", QUESTION, model="smol-lora", max_tokens=12)))[0]
        assert lora_ids != base_ids

        async def mixed() -> list[list[int]]:
            reqs = [
                _request("m0", QUESTION, max_tokens=12),
                _request("m1", QUESTION, model="smol-lora", max_tokens=12),
                _request("m2", QUESTION, max_tokens=12),
                _request("m3", QUESTION, model="smol-lora", max_tokens=12),
            ]
            return [r[0] for r in await asyncio.gather(*(_tokens(engine, r) for r in reqs))]

        assert _run(mixed()) == [base_ids, lora_ids, base_ids, lora_ids]
    finally:
        engine.unload_adapter_sync("smol-lora")
    assert "smol-lora" not in engine.adapters


def test_the_gguf_form_holds_the_peft_matrices_under_llama_cpp_names(
    peft_adapter: Path, tmp_path: Path
) -> None:
    """Read back: alpha (llama.cpp scales by alpha / rank, as PEFT), every A as it is, every
    q/k B with its rows in llama.cpp's RoPE order, the others as they are."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from services.inference.engine.gguf_lora import BaseShape, convert_peft_lora

    out = convert_peft_lora(peft_adapter, BaseShape("llama", 30, 9, 3), tmp_path / "a.gguf")
    reader = gguf.GGUFReader(str(out))
    alpha = reader.fields["adapter.lora.alpha"]
    assert float(alpha.parts[alpha.data[0]][0]) == 16.0
    tensors = {t.name: np.array(t.data).reshape([int(x) for x in reversed(t.shape)]) for t in reader.tensors}
    assert len(tensors) == 30 * 4 * 2
    peft = load_file(str(peft_adapter / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.7.self_attn"
    np.testing.assert_array_equal(
        tensors["blk.7.attn_q.weight.lora_a"], peft[f"{prefix}.q_proj.lora_A.weight"]
    )
    np.testing.assert_array_equal(
        tensors["blk.7.attn_v.weight.lora_b"], peft[f"{prefix}.v_proj.lora_B.weight"]
    )
    q_b = peft[f"{prefix}.q_proj.lora_B.weight"]  # 9 heads of 64 rows: the halves of each head interleaved
    expected = q_b.reshape(9, 2, 32, 8).swapaxes(1, 2).reshape(q_b.shape)
    np.testing.assert_array_equal(tensors["blk.7.attn_q.weight.lora_b"], expected)
    assert not np.array_equal(expected, q_b)


@needs_llama
def test_adapters_it_cannot_apply_are_refused_naming_them(
    engine: Any, tmp_path: Path, peft_adapter: Path
) -> None:
    empty = tmp_path / "not-an-adapter"
    empty.mkdir()
    with pytest.raises(AdapterError, match=r"not-an-adapter.*adapter_config\.json"):
        engine.load_adapter_sync("x", str(empty))
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((peft_adapter / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes(
        (peft_adapter / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(AdapterError, match=r"dora.*DoRA"):
        engine.load_adapter_sync("x", str(dora))
    assert "x" not in engine.adapters


# --- through the service (OpenAI API) ------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[str]:
    if not HAVE_LLAMA:
        pytest.skip("llama_cpp (llama-cpp-python) is not installed")
    from services.inference.app import create_app
    from tests.helpers.servers import serve_app

    home = tmp_path_factory.mktemp("llamacpp-home")
    settings = InferenceSettings(
        engine="llamacpp", max_batch_size=4, max_model_len=512, threads=1, embedding_models=""
    )
    with serve_app(create_app(_common(home, redis_url), settings)) as url:
        yield url


@needs_llama
def test_openai_chat_streaming_and_concurrent_requests(llama_server: str, key: str) -> None:
    client = openai.OpenAI(base_url=llama_server + "/v1", api_key=key, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    caps = client.get("/capabilities", cast_to=object)
    assert caps["engine"] == "llamacpp" and caps["adapters"] is True  # type: ignore[index]
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=QUESTION,
        temperature=0,
        max_tokens=20,  # type: ignore[arg-type]
    )
    answer = reply.choices[0].message.content
    assert answer and reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and 3 < reply.usage.completion_tokens <= 20

    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=QUESTION,
        temperature=0,
        max_tokens=20,
        stream=True,  # type: ignore[arg-type]
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert len(chunks) > 3  # streamed piece by piece, not in one chunk

    # more requests than slots, at once: each gets the answer it gets alone
    answers: list[str | None] = [None] * 6

    def ask(i: int) -> None:
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=QUESTION,
            temperature=0,
            max_tokens=20,  # type: ignore[arg-type]
        )
        answers[i] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [answer] * 6
