"""LoRA adapters loaded, used side by side and unloaded at run time; full models registered;
the remote engine forwarding to a second instance of this service."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from services.common.auth import KeyStore
from services.common.config import CommonSettings
from services.inference.app import create_app
from services.inference.config import InferenceSettings
from tests.helpers.models import greedy_reference, make_lora_adapter
from tests.helpers.servers import serve_app

PROMPT = "The adapters say"
N = 16


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("inference-lora-home")
    (home / "models").mkdir()
    return home


@pytest.fixture(scope="module")
def key(redis_url: str) -> str:
    """An operator key: these tests load shared adapters and register shared models."""
    import redis

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        # the session's Valkey is shared: start from an empty model registry
        for name in client.keys("tandem:models:*"):
            client.delete(name)
        return KeyStore(client).create("acme", operator=True)[0]
    finally:
        client.close()


def _make_adapter(base: Path, target: Path, seed: int, modules: list[str] | None = None) -> Path:
    return make_lora_adapter(base, target, seed, modules=modules or ["q_proj", "v_proj", "o_proj", "up_proj"])


def _reference(base: Path, adapter: Path | None, n: int = N) -> str:
    return greedy_reference(base, adapter, PROMPT, n)


@pytest.fixture(scope="module")
def adapters(home: Path, lively_tiny_path: Path) -> dict[str, Path]:
    root = home / "models" / "adapters"
    return {
        "a1": _make_adapter(lively_tiny_path, root / "a1", 1),
        "a2": _make_adapter(lively_tiny_path, root / "a2", 2),
    }


@pytest.fixture(scope="module")
def server(home: Path, redis_url: str, lively_tiny_path: Path) -> Iterator[tuple[str, Any]]:
    common = CommonSettings(home=home, redis_url=redis_url, log_json=False)
    settings = InferenceSettings(
        model=str(lively_tiny_path), served_model_name="tiny", max_model_len=256, max_batch_size=4
    )
    app = create_app(common, settings)
    with serve_app(app) as url:
        yield url, app


def _complete(client: openai.OpenAI, model: str) -> str:
    r = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text


def test_adapters_load_use_side_by_side_and_unload(
    server: tuple[str, Any], key: str, adapters: dict[str, Path], lively_tiny_path: Path, home: Path
) -> None:
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    h = {"Authorization": f"Bearer {key}"}
    refs = {
        "tiny": _reference(lively_tiny_path, None),
        "a1": _reference(lively_tiny_path, adapters["a1"]),
        "a2": _reference(lively_tiny_path, adapters["a2"]),
    }
    assert len(set(refs.values())) == 3, "the adapters should change the output"
    for name in ("a1", "a2"):
        r = httpx.post(
            url + "/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": str(adapters[name])},
            headers=h,
        )
        assert r.status_code == 200, r.text
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "a1", "a2", "all-MiniLM-L6-v2"}
    assert models["a1"].model_extra["parent"] == "tiny"  # type: ignore[index]
    for name, ref in refs.items():
        assert _complete(client, name) == ref

    # all three at once: they share the batch (per-row adapters) and each stays right
    got: dict[str, str] = {}
    threads = [
        threading.Thread(target=lambda m=m: got.__setitem__(m, _complete(client, m)))
        for m in ("tiny", "a1", "a2", "a1")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == refs

    r = httpx.post(
        url + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(adapters["a1"])}, headers=h
    )
    assert r.status_code == 409
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a1"}, headers=h)
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a1")
    assert {m.id for m in client.models.list().data} == {"tiny", "a2", "all-MiniLM-L6-v2"}
    assert _complete(client, "a2") == refs["a2"]
    assert _complete(client, "tiny") == refs["tiny"]
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a1"}, headers=h)
    assert r.status_code == 404
    # unloading the last adapter leaves the plain base model serving
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a2"}, headers=h).status_code == 200
    assert _complete(client, "tiny") == refs["tiny"]


def test_bad_adapter_paths_are_4xx(
    server: tuple[str, Any], key: str, home: Path, lively_tiny_path: Path, tmp_path: Path
) -> None:
    url, _ = server
    h = {"Authorization": f"Bearer {key}"}

    def load(name: str, path: str) -> httpx.Response:
        return httpx.post(
            url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=h, timeout=60
        )

    missing = load("x", str(home / "models" / "adapters" / "nope"))
    assert missing.status_code == 400 and "does not exist" in missing.json()["error"]["message"]
    outside = load("x", str(tmp_path))
    assert outside.status_code == 400 and "outside the allowed roots" in outside.json()["error"]["message"]
    not_adapter = home / "models" / "plain-model"
    shutil.copytree(lively_tiny_path, not_adapter, dirs_exist_ok=True)
    r = load("x", str(not_adapter))
    assert r.status_code == 400 and "not a PEFT adapter" in r.json()["error"]["message"]
    wrong = _make_adapter(lively_tiny_path, home / "models" / "adapters" / "wrong", 3, modules=["q_proj"])
    cfg = wrong / "adapter_config.json"
    cfg.write_text(cfg.read_text().replace('"q_proj"', '"no_such_module"'))
    r = load("wrong", str(wrong))
    assert r.status_code == 400, r.text
    assert load("x", "../../etc").status_code == 400
    bad_name = load("bad name!", str(wrong))
    assert bad_name.status_code == 400
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    assert {m.id for m in client.models.list().data} == {"tiny", "all-MiniLM-L6-v2"}  # + the embedding model
    assert _complete(client, "tiny")  # still serving


def test_register_full_model(server: tuple[str, Any], key: str, home: Path, tiny_model_path: Path) -> None:
    url, _ = server
    h = {"Authorization": f"Bearer {key}"}
    target = home / "models" / "finetuned"
    shutil.copytree(tiny_model_path, target, dirs_exist_ok=True)
    # a fine-tune saved without tokenizer files borrows the base model's
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()
    r = httpx.post(
        url + "/v1/models/register", json={"name": "tiny-ft", "path": str(target)}, headers=h, timeout=120
    )
    assert r.status_code == 200, r.text
    again = httpx.post(
        url + "/v1/models/register", json={"name": "tiny-ft", "path": str(target)}, headers=h, timeout=120
    )
    assert again.status_code == 409
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    assert "tiny-ft" in {m.id for m in client.models.list().data}
    ref = _reference(tiny_model_path, None)
    assert _complete(client, "tiny-ft") == ref
    assert httpx.post(url + "/v1/models/unregister", json={"name": "tiny-ft"}, headers=h).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "tiny-ft")


def test_remote_engine_forwards_to_a_second_instance(
    server: tuple[str, Any], key: str, home: Path, redis_url: str
) -> None:
    upstream, _ = server
    common = CommonSettings(home=home, redis_url=redis_url, log_json=False)
    settings = InferenceSettings(engine="remote", remote_url=upstream, remote_api_key=key)
    app = create_app(common, settings)
    direct = openai.OpenAI(base_url=upstream + "/v1", api_key=key, max_retries=0, timeout=120)
    with serve_app(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
        assert "tiny" in {m.id for m in client.models.list().data}
        # The upstream's embedding model is not taken for a chat model: listed once, the proxy's own.
        embed = [m for m in client.models.list().data if m.id == "all-MiniLM-L6-v2"]
        assert [m.kind for m in embed] == ["embedding"]  # type: ignore[attr-defined]
        msgs = [{"role": "user", "content": "Through the proxy"}]
        want = direct.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)  # type: ignore[arg-type]
        got = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)  # type: ignore[arg-type]
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage is not None and want.usage is not None
        assert got.usage.completion_tokens == want.usage.completion_tokens
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=msgs,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},  # type: ignore[arg-type]
            )
        )
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            == want.choices[0].message.content
        )
        assert chunks[-1].usage is not None
        comp = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
        )
        assert comp.choices[0].text == _complete(direct, "tiny")
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=msgs, max_tokens=2)  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w " * 400}])


def test_remote_engine_forwards_structured_output_and_tools(
    server: tuple[str, Any], key: str, home: Path, redis_url: str
) -> None:
    import json

    import jsonschema

    upstream, _ = server
    common = CommonSettings(home=home, redis_url=redis_url, log_json=False)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    msgs = [{"role": "user", "content": "JSON"}]
    for supported in (True, False):
        settings = InferenceSettings(
            engine="remote", remote_url=upstream, remote_api_key=key, remote_structured_outputs=supported
        )
        with serve_app(create_app(common, settings)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
            if supported:
                out = client.chat.completions.create(
                    model="tiny",
                    messages=msgs,
                    response_format=fmt,
                    max_tokens=40,  # type: ignore[arg-type]
                )
                jsonschema.validate(json.loads(out.choices[0].message.content or ""), schema)
            else:
                with pytest.raises(openai.BadRequestError) as err:
                    client.chat.completions.create(model="tiny", messages=msgs, response_format=fmt)  # type: ignore[arg-type]
                assert err.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]
            # tools go upstream as sent; the upstream's tool_calls come back, whole or streamed
            params = {
                "type": "object",
                "properties": {"x": {"enum": [1, 2]}},
                "required": ["x"],
                "additionalProperties": False,
            }
            tool = {"type": "function", "function": {"name": "f", "parameters": params}}
            got = client.chat.completions.create(
                model="tiny",
                messages=msgs,
                tools=[tool],
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=60,  # type: ignore[arg-type,list-item]
            )
            assert got.choices[0].finish_reason == "tool_calls", got.choices[0].message
            (call,) = got.choices[0].message.tool_calls or []
            assert call.function.name == "f"  # type: ignore[union-attr]
            jsonschema.validate(json.loads(call.function.arguments), params)  # type: ignore[union-attr]
            chunks = list(
                client.chat.completions.create(
                    model="tiny",
                    messages=msgs,  # type: ignore[arg-type]
                    tools=[tool],  # type: ignore[list-item]
                    tool_choice="required",
                    parallel_tool_calls=False,
                    max_tokens=60,
                    stream=True,
                )
            )
            deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
            assert deltas[0].id and deltas[0].function and deltas[0].function.name == "f"
            args = "".join(d.function.arguments or "" for d in deltas if d.function)
            jsonschema.validate(json.loads(args), params)
            assert [
                c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
            ] == ["tool_calls"]
