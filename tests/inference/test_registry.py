"""The durable, tenant-scoped model registry: published adapters survive a restart and are
served by a second replica (same Redis, same storage) without publishing again; at most
``max_adapters`` stay resident; tenants see and use only their own fine-tunes; operator
routes refuse other keys. Real Valkey, real HTTP, a real torch engine on a tiny model."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import torch

from services.common.auth import KeyStore, Principal
from services.common.config import CommonSettings
from services.inference.app import create_app
from services.inference.config import InferenceSettings
from services.inference.registry import ModelRegistry, RecordStore
from tests.helpers.models import greedy_reference, make_lora_adapter
from tests.helpers.servers import serve_app

PROMPT = "The registry says"
N = 12


def _reference(base: Path, adapter: Path | None) -> str:
    return greedy_reference(base, adapter, PROMPT, N)


@pytest.fixture(scope="module")
def db_url(redis_url: str) -> str:
    """A database of its own in the session's Valkey: the registry's records are global."""
    url = redis_url.rsplit("/", 1)[0] + "/5"
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    return url


@pytest.fixture(scope="module")
def keys(db_url: str) -> dict[str, str]:
    client = redis.Redis.from_url(db_url, decode_responses=True)
    try:
        store = KeyStore(client)
        return {
            "operator": store.create("system", operator=True)[0],
            "acme": store.create("acme")[0],
            "globex": store.create("globex")[0],
        }
    finally:
        client.close()


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("registry-home")
    (home / "models").mkdir()
    return home


@pytest.fixture(scope="module")
def adapters(home: Path, lively_tiny_path: Path) -> dict[str, Path]:
    root = home / "models" / "adapters"
    return {
        "a1": make_lora_adapter(lively_tiny_path, root / "a1", 1),
        "a2": make_lora_adapter(lively_tiny_path, root / "a2", 2),
        "wide": make_lora_adapter(lively_tiny_path, root / "wide", 3, r=16),
    }


@pytest.fixture(scope="module")
def refs(adapters: dict[str, Path], lively_tiny_path: Path) -> dict[str, str]:
    out = {"tiny": _reference(lively_tiny_path, None)}
    out.update({n: _reference(lively_tiny_path, adapters[n]) for n in ("a1", "a2")})
    assert len(set(out.values())) == 3, "the adapters should change the output"
    return out


@pytest.fixture(scope="module")
def replica(home: Path, db_url: str, lively_tiny_path: Path) -> Callable[..., Any]:
    """Makes an inference app over the module's Redis database and storage: each call a new
    replica (or a restarted one) of the same deployment; keyword arguments are settings."""

    def make(**extra: Any) -> Any:
        common = CommonSettings(home=home, redis_url=db_url, log_json=False)
        settings = InferenceSettings(
            model=str(lively_tiny_path),
            served_model_name="tiny",
            max_model_len=256,
            max_batch_size=4,
            **extra,
        )
        return create_app(common, settings)

    return make


@pytest.fixture(scope="module")
def server(replica: Callable[..., Any]) -> Iterator[tuple[str, Any]]:
    app = replica()
    with serve_app(app) as url:
        yield url, app


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _complete(url: str, key: str, model: str, headers: dict[str, str] | None = None) -> str:
    client = openai.OpenAI(
        base_url=url + "/v1", api_key=key, max_retries=0, timeout=120, default_headers=headers
    )
    r = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text


def _models(url: str, key: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(url + "/v1/models", headers=_h(key))
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


def _publish(url: str, key: str, name: str, path: Path, tenant: str | None = None) -> httpx.Response:
    body: dict[str, Any] = {"lora_name": name, "lora_path": str(path)}
    if tenant is not None:
        body["tenant"] = tenant
    return httpx.post(url + "/v1/load_lora_adapter", json=body, headers=_h(key), timeout=120)


def test_operator_routes_refuse_tenant_keys(
    server: tuple[str, Any], keys: dict[str, str], adapters: dict[str, Path], home: Path
) -> None:
    url, _ = server
    for tenant in ("acme", "globex"):
        r = _publish(url, keys[tenant], "sneaky", adapters["a1"], tenant=tenant)
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "forbidden"
        r = httpx.post(
            url + "/v1/models/register",
            json={"name": "sneaky", "path": str(adapters["a1"])},
            headers=_h(keys[tenant]),
        )
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert "sneaky" not in _models(url, keys["acme"])
    # a shared adapter: every tenant uses it, only an operator removes it
    assert _publish(url, keys["operator"], "shared-a2", adapters["a2"]).status_code == 200
    for tenant in ("acme", "globex"):
        assert _models(url, keys[tenant])["shared-a2"]["owned_by"] == "tandem"
        r = httpx.delete(url + "/v1/models/shared-a2", headers=_h(keys[tenant]))
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
        r = httpx.post(
            url + "/v1/unload_lora_adapter", json={"lora_name": "shared-a2"}, headers=_h(keys[tenant])
        )
        assert r.status_code == 403
    r = httpx.post(
        url + "/v1/unload_lora_adapter", json={"lora_name": "shared-a2"}, headers=_h(keys["operator"])
    )
    assert r.status_code == 200
    assert "shared-a2" not in _models(url, keys["acme"])


def test_tenant_adapter_is_listed_used_and_deleted_by_its_tenant_only(
    server: tuple[str, Any], keys: dict[str, str], adapters: dict[str, Path], refs: dict[str, str]
) -> None:
    url, _ = server
    r = _publish(url, keys["operator"], "ft-acme1", adapters["a1"], tenant="acme")
    assert r.status_code == 200, r.text
    assert _publish(url, keys["operator"], "ft-acme1", adapters["a2"], tenant="globex").status_code == 409

    mine = _models(url, keys["acme"])
    assert mine["ft-acme1"]["kind"] == "adapter"
    assert mine["ft-acme1"]["owned_by"] == "acme" and mine["ft-acme1"]["parent"] == "tiny"
    assert mine["tiny"]["kind"] == "base"
    assert set(_models(url, keys["globex"])) == {"tiny", "all-MiniLM-L6-v2"}  # + the embedding model
    assert "ft-acme1" not in _models(url, keys["operator"])  # an operator's listing is its own tenant's too

    assert _complete(url, keys["acme"], "ft-acme1") == refs["a1"]
    assert _complete(url, keys["globex"], "tiny") == refs["tiny"]
    # another tenant: exactly as if the model did not exist
    for call in (
        lambda: _complete(url, keys["globex"], "ft-acme1"),
        lambda: _complete(url, keys["globex"], "no-such-model"),
    ):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.code == "model_not_found"
    chat = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "ft-acme1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers=_h(keys["globex"]),
    )
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "model_not_found"
    assert httpx.get(url + "/v1/models/ft-acme1", headers=_h(keys["globex"])).status_code == 404
    assert httpx.get(url + "/v1/models/ft-acme1", headers=_h(keys["acme"])).json()["owned_by"] == "acme"
    gone = httpx.delete(url + "/v1/models/ft-acme1", headers=_h(keys["globex"]))
    assert gone.status_code == 404 and "ft-acme1" in gone.json()["error"]["message"]
    unload = httpx.post(
        url + "/v1/unload_lora_adapter", json={"lora_name": "ft-acme1"}, headers=_h(keys["globex"])
    )
    assert unload.status_code == 404
    assert _complete(url, keys["acme"], "ft-acme1") == refs["a1"]  # untouched

    r = httpx.delete(url + "/v1/models/ft-acme1", headers=_h(keys["acme"]))
    assert r.status_code == 200 and r.json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        _complete(url, keys["acme"], "ft-acme1")
    assert "ft-acme1" not in _models(url, keys["acme"])
    assert httpx.delete(url + "/v1/models/ft-acme1", headers=_h(keys["acme"])).status_code == 404
    assert httpx.delete(url + "/v1/models/tiny", headers=_h(keys["operator"])).status_code == 404

    # an operator may delete a tenant's fine-tune
    assert _publish(url, keys["operator"], "ft-acme2", adapters["a2"], tenant="acme").status_code == 200
    assert httpx.delete(url + "/v1/models/ft-acme2", headers=_h(keys["operator"])).status_code == 200
    assert "ft-acme2" not in _models(url, keys["acme"])


def test_an_operator_acting_for_a_tenant_uses_that_tenants_models_and_no_more(
    server: tuple[str, Any], keys: dict[str, str], adapters: dict[str, Path], refs: dict[str, str]
) -> None:
    """X-Tandem-Tenant (the trainer's worker writing a job's questions with the model its tenant
    named): an operator key sending it is that tenant for the request (its fine-tunes and the
    shared models, nothing else); a tenant key sending it is refused."""
    url, _ = server
    assert _publish(url, keys["operator"], "ft-acme-act", adapters["a1"], tenant="acme").status_code == 200
    acting = {"X-Tandem-Tenant": "acme"}
    try:
        assert _complete(url, keys["operator"], "ft-acme-act", acting) == refs["a1"]
        assert _complete(url, keys["operator"], "tiny", acting) == refs["tiny"]
        # the operator's own tenant, or acting for another tenant: acme's model does not exist
        for headers in (None, {"X-Tandem-Tenant": "globex"}):
            with pytest.raises(openai.NotFoundError) as err:
                _complete(url, keys["operator"], "ft-acme-act", headers)
            assert err.value.code == "model_not_found"
        # a tenant key never acts for anyone, its own tenant included
        for tenant in ("acme", "globex"):
            chat = httpx.post(
                url + "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                headers={**_h(keys[tenant]), "X-Tandem-Tenant": "acme"},
            )
            assert chat.status_code == 403, chat.text
            assert chat.json()["error"]["code"] == "forbidden"
            assert chat.json()["error"]["param"] == "X-Tandem-Tenant"
        bad = httpx.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
            headers={**_h(keys["operator"]), "X-Tandem-Tenant": "not a tenant!"},
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Tandem-Tenant", bad.text
    finally:
        assert httpx.delete(url + "/v1/models/ft-acme-act", headers=_h(keys["operator"])).status_code == 200


def test_published_adapter_survives_restart_and_serves_on_a_second_replica(
    home: Path,
    lively_tiny_path: Path,
    replica: Callable[..., Any],
    keys: dict[str, str],
    adapters: dict[str, Path],
    refs: dict[str, str],
) -> None:
    full = home / "models" / "full-copy"
    shutil.copytree(lively_tiny_path, full, dirs_exist_ok=True)
    first = replica()
    with serve_app(first) as url:
        assert _publish(url, keys["operator"], "ft-durable", adapters["a2"], tenant="acme").status_code == 200
        r = httpx.post(
            url + "/v1/models/register",
            json={"name": "ft-full", "path": str(full), "tenant": "acme"},
            headers=_h(keys["operator"]),
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert _complete(url, keys["acme"], "ft-durable") == refs["a2"]
        # a second replica over the same Redis and storage, started after the publish
        second = replica()
        with serve_app(second) as url2:
            assert "ft-durable" in _models(url2, keys["acme"])
            assert "ft-durable" not in _models(url2, keys["globex"])
            assert second.state.registry.loads == 0  # nothing loaded before use
            got: list[str] = []
            threads = [
                threading.Thread(target=lambda: got.append(_complete(url2, keys["acme"], "ft-durable")))
                for _ in range(3)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert got == [refs["a2"]] * 3
            assert second.state.registry.loads == 1  # concurrent first uses: loaded once
            # a registered full model: listed at once, its engine built on first use
            listed = _models(url2, keys["acme"])["ft-full"]
            assert listed["kind"] == "registered" and listed["owned_by"] == "acme"
            assert "ft-full" not in second.state.registry.registered
            assert _complete(url2, keys["acme"], "ft-full") == refs["tiny"]  # the same weights
            assert "ft-full" in second.state.registry.registered
            with pytest.raises(openai.NotFoundError):
                _complete(url2, keys["globex"], "ft-full")
            assert httpx.delete(url2 + "/v1/models/ft-full", headers=_h(keys["acme"])).status_code == 200
            with pytest.raises(openai.NotFoundError):
                _complete(url2, keys["globex"], "ft-durable")
            # deleted through the first replica: the second stops serving it too
            assert httpx.delete(url + "/v1/models/ft-durable", headers=_h(keys["acme"])).status_code == 200
            with pytest.raises(openai.NotFoundError):
                _complete(url2, keys["acme"], "ft-durable")
            assert "ft-durable" not in second.state.registry.resident
        assert (
            _publish(url, keys["operator"], "ft-durable2", adapters["a1"], tenant="acme").status_code == 200
        )
    # the first replica restarted: a new process over the same Redis and storage
    restarted = replica()
    with serve_app(restarted) as url:
        assert _models(url, keys["acme"])["ft-durable2"]["kind"] == "adapter"
        assert _complete(url, keys["acme"], "ft-durable2") == refs["a1"]
        assert httpx.delete(url + "/v1/models/ft-durable2", headers=_h(keys["acme"])).status_code == 200


def test_lru_cap_of_one_still_answers_every_adapter(
    replica: Callable[..., Any], keys: dict[str, str], adapters: dict[str, Path], refs: dict[str, str]
) -> None:
    app = replica(max_adapters=1, max_lora_rank=8)
    with serve_app(app) as url:
        caps = httpx.get(url + "/v1/capabilities", headers=_h(keys["acme"])).json()
        plan = caps.pop("forward_plan")
        assert caps == {"engine": "torch", "adapters": True, "max_lora_rank": 8, "register_models": True}
        assert plan["forward"] == "auto" and plan["reasons"]
        r = _publish(url, keys["operator"], "ft-wide", adapters["wide"], tenant="acme")
        assert r.status_code == 400 and "max_lora_rank 8" in r.json()["error"]["message"]
        for name in ("a1", "a2"):
            assert (
                _publish(url, keys["operator"], f"ft-lru-{name}", adapters[name], tenant="acme").status_code
                == 200
            )
        registry = app.state.registry
        assert list(registry.resident) == ["ft-lru-a2"]
        for name in ("a1", "a2", "a1", "tiny", "a2"):
            model = "tiny" if name == "tiny" else f"ft-lru-{name}"
            assert _complete(url, keys["acme"], model) == refs[name], name
            assert len(registry.resident) == 1
        assert list(registry.resident) == ["ft-lru-a2"]
        for name in ("a1", "a2"):
            assert (
                httpx.delete(url + f"/v1/models/ft-lru-{name}", headers=_h(keys["acme"])).status_code == 200
            )


def test_capabilities_default_torch(server: tuple[str, Any], keys: dict[str, str]) -> None:
    url, _ = server
    assert httpx.get(url + "/v1/capabilities").status_code == 401
    caps = httpx.get(url + "/v1/capabilities", headers=_h(keys["globex"])).json()
    plan = caps.pop("forward_plan")
    assert caps == {"engine": "torch", "adapters": True, "max_lora_rank": None, "register_models": True}
    assert plan["forward"] == "auto" and plan["reasons"]


def test_eviction_skips_adapters_with_running_requests(
    db_url: str, lively_tiny_path: Path, adapters: dict[str, Path]
) -> None:
    """Registry level, with a real engine: a lease (a running request) pins its adapter."""
    from services.common.redis_conn import async_redis
    from services.inference.engine.torch_engine import TorchEngine

    acme = Principal("acme", "k1")
    operator = Principal("system", "k0", operator=True)

    async def scenario() -> None:
        client = async_redis(db_url)
        engine = TorchEngine.from_pretrained(lively_tiny_path, name="tiny", device="cpu", dtype=torch.float32)
        await engine.start()
        reg = ModelRegistry(engine, None, RecordStore(client), max_adapters=1)
        try:
            await reg.load_adapter("ft-pin-a1", adapters["a1"], "acme")
            await reg.load_adapter("ft-pin-a2", adapters["a2"], "acme")
            assert list(reg.resident) == ["ft-pin-a2"] and reg.loads == 2
            # five concurrent first uses of a1: one load (evicting the idle a2)
            leases = await asyncio.gather(*(reg.acquire("ft-pin-a1", acme) for _ in range(5)))
            assert reg.loads == 3 and list(reg.resident) == ["ft-pin-a1"] and reg.busy["ft-pin-a1"] == 5
            # a1 is running: a2 loads over the cap instead of evicting it
            lease2 = await reg.acquire("ft-pin-a2", acme)
            assert set(reg.resident) == {"ft-pin-a1", "ft-pin-a2"} and set(engine.adapters) == set(
                reg.resident
            )
            for lease in leases:
                lease.release()
            lease2.release()
            assert reg.busy == {}
            # idle again: the next load evicts down to the cap, least recently used first
            await reg.load_adapter("ft-pin-a3", adapters["a1"], "acme")
            assert list(reg.resident) == ["ft-pin-a3"]
            with pytest.raises(Exception, match="does not exist"):
                await reg.acquire("ft-pin-a3", Principal("globex", "k2"))
            for name in ("ft-pin-a1", "ft-pin-a2", "ft-pin-a3"):
                await reg.remove(name, operator)
            assert reg.resident == {} and engine.adapters == {}
        finally:
            await engine.shutdown()
            await client.aclose()

    asyncio.run(scenario())
