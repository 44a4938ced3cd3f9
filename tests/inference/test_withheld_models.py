"""A fine-tune trained on feedback about collections a person may not read is not served to that
person by the inference service either (chat, completions, Responses, streamed or not), unless an
admin allowed it for the tenant: the same decision the agent makes
(services/common/model_restrictions.py). Real Valkey, real HTTP, a real torch engine on a tiny
model with a real LoRA adapter; the people, access lists and the model's record are written with
the stores the services use."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from services.common.access import AccessList, AccessStore
from services.common.auth import KeyStore
from services.common.config import CommonSettings
from services.common.model_restrictions import ModelRestrictions
from services.common.redis_conn import async_redis
from services.inference.app import create_app
from services.inference.config import InferenceSettings
from tests.helpers.models import make_lora_adapter
from tests.helpers.people import Person, person
from tests.helpers.servers import serve_app

MESSAGES = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class Tenant:
    url: str
    redis_url: str
    name: str
    model: str
    admin: str
    operator: str
    reader: Person  # may read the collection the model was trained on
    other: Person  # may not


def _h(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


def _in_redis(redis_url: str, work: Any) -> None:
    async def run() -> None:
        client = async_redis(redis_url)
        try:
            await work(client)
        finally:
            await client.aclose()

    asyncio.run(run())


def _record(t: Tenant, collections: list[str], allowed: bool) -> None:
    _in_redis(t.redis_url, lambda c: ModelRestrictions(c).put(t.name, [t.model], collections, allowed))


@pytest.fixture(scope="module")
def tenant(
    redis_url: str, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Tenant]:
    home = tmp_path_factory.mktemp("withheld-home")
    adapter = make_lora_adapter(tiny_model_path, home / "models" / "adapters" / "fb", 1)
    name, model = f"w{secrets.token_hex(4)}", f"ft-{secrets.token_hex(4)}"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        keys = KeyStore(client)
        operator = keys.create("system", operator=True)[0]
        admin = keys.create(name, "admin", role="admin")[0]
    finally:
        client.close()
    reader, other = person(redis_url, name), person(redis_url, name)
    acl = AccessList(readers=[reader.entry], writers=[])
    _in_redis(redis_url, lambda c: AccessStore(c).put(name, "hr", acl))
    common = CommonSettings(home=home, redis_url=redis_url, log_json=False)
    settings = InferenceSettings(
        model=str(tiny_model_path), served_model_name="tiny", max_model_len=256, max_batch_size=4
    )
    with serve_app(create_app(common, settings)) as url:
        published = httpx.post(
            url + "/v1/load_lora_adapter",
            json={"lora_name": model, "lora_path": str(adapter), "tenant": name},
            headers=_h(operator),
            timeout=120,
        )
        assert published.status_code == 200, published.text
        t = Tenant(url, redis_url, name, model, admin, operator, reader, other)
        _record(t, ["hr"], allowed=False)
        yield t


def _calls(model: str, stream: bool) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": 2, "stream": stream}),
        ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2, "stream": stream}),
        ("/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 2, "stream": stream}),
    ]


def _each(t: Tenant, key: str, model: str | None = None, **headers: str) -> list[httpx.Response]:
    """Every generation route, plain and streamed, as ``key`` naming ``model`` (the fine-tune)."""
    out = []
    for stream in (False, True):
        for path, body in _calls(model or t.model, stream):
            out.append(httpx.post(t.url + path, json=body, headers=_h(key, **headers), timeout=120))
    return out


def _served(answers: list[httpx.Response]) -> None:
    for r in answers:
        assert r.status_code == 200, (r.request.url.path, r.text)
        assert "model_withheld" not in r.text


def _refused(t: Tenant, answers: list[httpx.Response]) -> None:
    for r in answers:
        assert r.status_code == 403, (r.request.url.path, r.text)
        error = r.json()["error"]
        assert error["code"] == "model_withheld" and error["param"] == "model"
        message = error["message"]
        # says why and how it is allowed, without naming the collection
        assert "may not read" in message and f"POST /v1/models/{t.model}/allow" in message
        assert "hr" not in message.replace(t.model, "")


def test_a_person_who_may_not_read_its_collections_is_refused_the_fine_tune_everywhere(
    tenant: Tenant,
) -> None:
    t = tenant
    _refused(t, _each(t, t.other.token))
    _served(_each(t, t.other.token, model="tiny"))  # the base model still answers
    _served(_each(t, t.reader.token))
    _served(_each(t, t.admin))  # an admin reads every collection
    _served(_each(t, t.operator, **{"X-Tandem-Tenant": t.name}))  # acting for the tenant: its admin


def test_an_admins_allowance_serves_it_to_everyone_until_withdrawn(tenant: Tenant) -> None:
    t = tenant
    try:
        _record(t, ["hr"], allowed=True)
        _served(_each(t, t.other.token))
        _record(t, ["hr"], allowed=False)
        _refused(t, _each(t, t.other.token))
        # a collection without an access list is open to the tenant: nothing is withheld for it
        _record(t, ["open-to-all"], allowed=False)
        _served(_each(t, t.other.token))
        # readable once the list names the person
        _record(t, ["hr"], allowed=False)
        both = AccessList(readers=[t.reader.entry, t.other.entry], writers=[])
        _in_redis(t.redis_url, lambda c: AccessStore(c).put(t.name, "hr", both))
        _served(_each(t, t.other.token))
    finally:
        only = AccessList(readers=[t.reader.entry], writers=[])
        _in_redis(t.redis_url, lambda c: AccessStore(c).put(t.name, "hr", only))
        _record(t, ["hr"], allowed=False)
