"""A/B comparison of server configurations in one run (``--variant``): every variant's server
runs at once (idle ones wait on a condition, costing no CPU) and the loads interleave, round
after round (variant A, B, C at 1 stream, then at 16, then again), so the drift of a shared
machine hits every variant alike; each figure is the median over rounds.

    python -m benchmarks.inference --threads 2 --rounds 3 --concurrency 1,16 \\
        --variant fp32=TANDEM_INFERENCE_QUANTIZE=none \\
        --variant int4=TANDEM_INFERENCE_QUANTIZE=int4
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Variant:
    name: str
    env: dict[str, str]
    runs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # streams -> one result a round


def parse_variant(text: str) -> Variant:
    """``name=TANDEM_INFERENCE_X=1,TANDEM_INFERENCE_Y=2`` (no settings: the defaults)."""
    name, _, rest = text.partition("=")
    env: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("TANDEM_INFERENCE_"):
            raise ValueError(f"--variant {text!r}: {item!r} is not TANDEM_INFERENCE_NAME=VALUE")
        env[key] = value
    if not name:
        raise ValueError(f"--variant {text!r} has no name")
    return Variant(name, env)


def run_variants(
    variants: list[Variant],
    levels: list[int],
    rounds: int,
    per_stream: Callable[[int], int],
    max_tokens: int,
    start: Callable[[dict[str, str]], tuple[Any, str]],
    load: Callable[..., Any],
    key: str,
) -> None:
    servers = []
    try:
        for v in variants:
            print(f"starting server {v.name} {v.env or '(defaults)'} ...", flush=True)
            servers.append(start(v.env))
        for _, url in servers:
            asyncio.run(load(url, key, "bench", 1, 1, 8))  # warm-up
        for r in range(rounds):
            for c in levels:
                for v, (_, url) in zip(variants, servers, strict=True):
                    print(f"round {r + 1}/{rounds}: {v.name}, {c} streams ...", flush=True)
                    res = asyncio.run(load(url, key, "bench", c, per_stream(c), max_tokens))
                    v.runs.setdefault(c, []).append(res)
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(30)


def report(variants: list[Variant], levels: list[int], pct: Callable[[list[float], float], float]) -> None:
    print()
    print(
        "| variant | streams | tokens/s (median of rounds) | rounds | vs first | TTFT p50 / p95 ms | ITL p50 / p95 ms |"
    )
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: |")
    first: dict[int, float] = {}
    for v in variants:
        for c in levels:
            runs = v.runs.get(c, [])
            if not runs:
                continue
            each = [r["tokens"] / r["wall"] for r in runs]
            tps = statistics.median(each)
            first.setdefault(c, tps)
            ttft = [x for r in runs for x in r["ttft"]]
            itl = [x for r in runs for x in r["itl"]]
            ms = lambda x: f"{x * 1000:.0f}"  # noqa: E731
            print(
                f"| {v.name} | {c} | {tps:.1f} | {' / '.join(f'{x:.1f}' for x in each)} | "
                f"{tps / first[c]:.2f}x | {ms(pct(ttft, 0.5))} / {ms(pct(ttft, 0.95))} | "
                f"{ms(pct(itl, 0.5))} / {ms(pct(itl, 0.95))} |"
            )


def compare(
    args: Any, model_dir: Path, tmpdir: Path, dtype: str, levels: list[int], extra_env: dict[str, str]
) -> int:
    """``--variant`` runs: no transformers baseline, the variants against each other."""
    import redis

    from benchmarks.inference.__main__ import load, pct, start_server
    from services.common.auth import KeyStore
    from tests.helpers.servers import valkey_server

    variants = [parse_variant(v) for v in args.variant]
    with valkey_server(tmpdir / "valkey") as redis_url:
        key = KeyStore(redis.Redis.from_url(redis_url, decode_responses=True)).create("bench")[0]

        homes = iter(range(len(variants)))
        # the same server settings as the baseline run's; each variant's own env on top
        shared = (args.device, dtype, max(levels), args.prefill_chunk, args.threads, args.prefix_cache_mb)

        def start(env: dict[str, str]) -> tuple[Any, str]:
            home = tmpdir / f"home-{next(homes)}"
            home.mkdir()
            return start_server(model_dir, home, redis_url, *shared, {**extra_env, **env})

        run_variants(
            variants,
            levels,
            args.rounds,
            lambda c: args.per_stream or (4 if c == 1 else 3 if c <= 4 else 2),
            args.max_tokens,
            start,
            load,
            key,
        )
    report(variants, levels, pct)
    return 0
