"""Fair sharing between tenants in the torch engine's scheduler and at the API: one
tenant's flood is that tenant's 429s (code ``rate_limit_exceeded``, ``Retry-After``),
another tenant still starts within a bounded number of steps, and ``n`` counts against
the tenant's share. Steps are driven inline (no scheduler thread), so every assertion is
on steps and admission order, never on wall-clock time."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.inference.engine import EngineRequest, SamplingParams, TorchEngine
from services.inference.engine.scheduler import DEFAULT_TENANT
from services.inference.engine.types import QueueFull

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def lively(lively_tiny_path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(lively_tiny_path)
    model = AutoModelForCausalLM.from_pretrained(lively_tiny_path, dtype=torch.float32).eval()
    return model, tok


def _submit(engine: TorchEngine, rid: str, tenant: str | None, n: int = 1) -> Any:
    """Submit through the engine's serving face (``generate``) without a scheduler thread:
    the sequences are queued; the caller drives ``step()``."""
    req = EngineRequest(
        request_id=rid,
        params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n),
        prompt_token_ids=[5, 6, 7, 8],
        tenant=tenant,
    )
    return asyncio.run(engine.generate(req))


def test_flood_gets_the_tenant_429_while_another_tenant_starts_within_bounded_steps(
    lively: tuple[Any, Any],
) -> None:
    model, tok = lively
    engine = TorchEngine.from_model(
        model, tok, max_batch_size=2, max_queue=100, tenant_max_queued=3, prefix_cache_mb=0
    )
    sched = engine.scheduler
    accepted, refused = [], []
    for i in range(20):
        try:
            _submit(engine, f"a{i}", "alpha")
            accepted.append(i)
        except QueueFull as exc:
            refused.append(exc)
    # alpha may wait its cap (3) plus the free slots while it is alone (2); the rest are 429s
    assert len(accepted) == 5 and len(refused) == 15
    assert all(e.code == "rate_limit_exceeded" and e.retry_after >= 1 for e in refused)
    assert "alpha" in str(refused[0]) and "limit is 3" in str(refused[0])
    # alpha's flood did not fill the global queue: bravo is accepted
    sched.step()  # alpha takes both slots
    assert [s.tenant for s in sched.slots] == ["alpha", "alpha"]
    start = sched.steps
    _submit(engine, "b0", "bravo")
    admitted_at: dict[str, int] = {}
    while sched.has_work():
        sched.step()
        for s in sched.slots:
            admitted_at.setdefault(s.request_id, sched.steps)
    # bravo gets the first slot that frees (before alpha's three waiting requests), so it
    # starts within one generation's steps of arriving
    assert admitted_at["b0"] - start <= MAX_TOKENS
    later_alpha = [rid for rid in ("a2", "a3", "a4") if rid in admitted_at]
    assert later_alpha and all(admitted_at[rid] >= admitted_at["b0"] for rid in later_alpha)
    assert admitted_at["b0"] < max(admitted_at[rid] for rid in later_alpha)


def test_round_robin_admission_between_tenants(lively: tuple[Any, Any]) -> None:
    """Three tenants queued behind a full batch are admitted alternately, not FIFO."""
    model, tok = lively
    engine = TorchEngine.from_model(
        model, tok, max_batch_size=1, max_queue=100, tenant_max_queued=10, prefix_cache_mb=0
    )
    sched = engine.scheduler
    for i in range(3):
        _submit(engine, f"a{i}", "alpha")
    for i in range(2):
        _submit(engine, f"b{i}", "bravo")
    _submit(engine, "c0", None)  # no tenant: the default tenant (the trainer's rollouts)
    order: list[str] = []
    while sched.has_work():
        sched.step()
        for s in sched.slots:
            if s.request_id not in order:
                order.append(s.request_id)
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2"], order
    assert DEFAULT_TENANT.startswith("_")


def test_n_counts_against_the_tenant_share(lively: tuple[Any, Any]) -> None:
    model, tok = lively
    engine = TorchEngine.from_model(
        model, tok, max_batch_size=1, max_queue=100, tenant_max_queued=2, prefix_cache_mb=0
    )
    # cap 2 + one free slot: n=4 is four sequences and is refused; n=3 fits
    with pytest.raises(QueueFull) as exc:
        _submit(engine, "big", "alpha", n=4)
    assert exc.value.code == "rate_limit_exceeded" and "asked for 4" in str(exc.value)
    _submit(engine, "ok", "alpha", n=3)
    # alpha's three waiting choices use up its share: even n=1 is refused now ...
    with pytest.raises(QueueFull):
        _submit(engine, "more", "alpha", n=1)
    # ... while bravo still gets in
    _submit(engine, "b", "bravo", n=2)
    engine.scheduler.run_until_done()


def test_trainer_batches_are_not_limited(lively: tuple[Any, Any]) -> None:
    """generate_batch (the trainer's rollouts, default tenant) is never refused by the share."""
    model, tok = lively
    engine = TorchEngine.from_model(
        model, tok, max_batch_size=2, max_queue=0, tenant_max_queued=0, prefix_cache_mb=0
    )
    outs = engine.generate_batch([[5, 6, 7]] * 3, SamplingParams(temperature=0, max_tokens=3, n=2))
    assert len(outs) == 6 and all(len(o.token_ids) == 3 for o in outs)


def test_api_tenant_share_is_openai_429_with_retry_after(
    tmp_path: Path, redis_url: str, lively_tiny_path: Path
) -> None:
    import redis

    from services.common.auth import KeyStore
    from services.common.config import CommonSettings
    from services.inference.app import create_app
    from services.inference.config import InferenceSettings
    from tests.helpers.servers import serve_app

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        key = KeyStore(client).create("fair-acme")[0]
    finally:
        client.close()
    common = CommonSettings(
        home=tmp_path, redis_url=redis_url, model_roots=str(tmp_path / "models"), log_json=False
    )
    settings = InferenceSettings(
        model=str(lively_tiny_path),
        served_model_name="tiny",
        max_batch_size=1,
        max_queue=8,
        tenant_max_queued=0,
    )
    app = create_app(common, settings)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    with serve_app(app) as url:
        headers = {"Authorization": f"Bearer {key}"}
        # n=2 is two sequences: more than the one free slot this tenant may take
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "n": 2}, headers=headers, timeout=60)
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and "fair-acme" in err["message"]
        assert isinstance(err["type"], str) and err["type"]
        ok = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert ok.status_code == 200, ok.text
