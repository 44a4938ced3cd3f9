"""The largest allowed request does not stall the event loop: /healthz answers within 200 ms
while an 8 MB chat message is read, checked and tokenised (measured by a bounded poll)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from services.common.config import CommonSettings
from services.inference.app import create_app
from services.inference.config import InferenceSettings
from tests.conftest import auth
from tests.helpers.servers import serve_app


def _poll_health_while(url: str, busy: threading.Event, done: threading.Event) -> list[float]:
    """Latencies of /healthz from when the big request is on the wire until it is answered
    (bounded: at most 600 polls)."""
    latencies: list[float] = []
    with httpx.Client(timeout=30) as c:
        busy.wait(30)
        for _ in range(600):
            if done.is_set():
                break
            t0 = time.perf_counter()
            assert c.get(f"{url}/healthz").status_code == 200
            latencies.append(time.perf_counter() - t0)
    return latencies


def test_healthz_stays_fast_during_an_8mb_chat_message(
    tmp_path: Path, redis_url: str, api_key: str, lively_tiny_path: Path
) -> None:
    common = CommonSettings(
        home=tmp_path, redis_url=redis_url, model_roots=str(tmp_path / "models"), log_json=False
    )
    settings = InferenceSettings(model=str(lively_tiny_path), served_model_name="tiny", max_model_len=256)
    # ordinary prose, ~8 MB: the tokenizer's real work (a single repeated character is cheaper)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
    message = (words * (8_000_000 // len(words)))[:8_000_000]
    busy, done = threading.Event(), threading.Event()
    result: dict[str, httpx.Response] = {}
    with serve_app(create_app(common, settings)) as url:
        httpx.get(f"{url}/healthz")

        def big() -> None:
            busy.set()
            try:
                result["r"] = httpx.post(
                    f"{url}/v1/chat/completions",
                    json={
                        "model": "tiny",
                        "messages": [{"role": "user", "content": message}],
                        "max_tokens": 2,
                    },
                    headers=auth(api_key),
                    timeout=300,
                )
            finally:
                done.set()

        worker = threading.Thread(target=big)
        worker.start()
        latencies = _poll_health_while(url, busy, done)
        worker.join(300)
    # the request is refused as too long for the model: after it was tokenised, as a 400
    assert result["r"].status_code == 400, result["r"].text[:300]
    assert "maximum context length" in result["r"].json()["error"]["message"]
    assert len(latencies) >= 3, latencies  # the request took long enough to measure
    # Within 200 ms (90th percentile; a stall on the loop held every poll for seconds: 7.3 s
    # before tokenisation moved off it). The max only bounds a scheduler hiccup on a busy machine.
    ordered = sorted(latencies)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    assert p90 < 0.2 and ordered[-1] < 1.0, (
        f"/healthz p90 {p90 * 1000:.0f} ms, max {ordered[-1] * 1000:.0f} ms ({len(latencies)} polls)"
    )
