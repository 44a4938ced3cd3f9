"""Inference throughput and latency: Tandem's engines (as servers) under 1, 4 and 16
concurrent streams, llama.cpp itself on the same GGUF file, and sequential ``transformers``
``generate``, in the same run.

    python -m benchmarks.inference                      # SmolLM2-135M on the CPU, every engine
    python -m benchmarks.inference --engines llamacpp-raw,llamacpp,torch --concurrency 1,16 --threads 2
    python -m benchmarks.inference --engines llamacpp-raw,llamacpp --lora-half   # + LoRA on half the streams
    python -m benchmarks.inference --device cuda        # random-init Llama-3.2-1B-sized model, bf16

Engines (``--engines``, comma-separated): ``generate`` (the baseline: ``model.generate`` of
the fp32 model in this process, one request at a time), ``llamacpp-raw`` (the contender:
llama.cpp through ``llama-cpp-python``'s low-level API in this process, one stream, and
several streams through its own batched decoding; see ``llamacpp_raw.py``), and Tandem's
``torch`` and ``llamacpp`` engines (``TANDEM_INFERENCE_ENGINE``). The llama.cpp ones need
``llama-cpp-python`` (the ``llamacpp`` extra) and the default model or a ``--model`` .gguf;
left out of the default run (with a note) where it is not installed.

Each Tandem server runs as its own process (uvicorn, as deployed), one at a time, with a
real Valkey for API keys; each of C client streams sends its requests one after another
(closed loop), every request a chat completion streamed over SSE with ``max_tokens``
tokens exactly (``ignore_eos``) and greedy decoding, so every run generates the same
token counts. Ratios are against llama.cpp's single stream when it ran, else against the
``generate`` segment run just before that level.

Prefill (``--prefill-tokens``, 1,500 by default; 0 turns it off): one long prompt at a time, the
median prompt tokens per second of ``--prefill-requests`` prompts, each starting with a number no
other prompt starts with (no prefix cache reuses more than the chat template's opening). llama.cpp
decodes the prompt's ids in one ``llama_decode`` in a context of its own; a Tandem server gets the
same text as a streamed chat completion of one token, and its rate is the prompt tokens of the
usage over the time to that token (HTTP included). Each server's prefill follows its decode levels
in every round and is rated against that round's llama.cpp prefill.

``--prompt-tokens N``: the decode levels send prompts of about N tokens (built as the prefill's
are) instead of short questions, so each step reads a RAG answer's long KV cache; TTFT then
includes each prompt's prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain how a rainbow forms.",
    "Give me three tips for learning a new language.",
    "What is photosynthesis?",
    "Describe the water cycle in simple terms.",
    "Why is the sky blue?",
    "How do vaccines work?",
    "Summarise the plot of Romeo and Juliet.",
    "What are the benefits of regular exercise?",
    "Explain what a neural network is.",
    "How does a refrigerator keep food cold?",
    "What causes the seasons on Earth?",
    "Suggest a name for a friendly robot.",
    "How do bees make honey?",
    "What is the difference between weather and climate?",
]


_request_numbers = itertools.count(1)


def unique_question(i: int) -> str:
    """Every request of a run asks something no earlier request asked (the number makes it
    unique), so the prefix cache can only reuse what real traffic shares: the chat
    template's system prompt, not whole repeated prompts."""
    return f"Request {next(_request_numbers)}: {QUESTIONS[i % len(QUESTIONS)]}"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def llama_1b_folder(target: Path, tokenizer_dir: Path) -> Path:
    """A random-initialised model with Llama-3.2-1B's shape (SmolLM2's tokenizer and vocabulary)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (target / "config.json").is_file():
        return target
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(target, safe_serialization=True)
    tok.save_pretrained(target)
    return target


# --- baseline ------------------------------------------------------------------------------------
class Baseline:
    """Sequential ``model.generate`` in this process (the server idles meanwhile)."""

    def __init__(self, model_dir: Path, device: str, dtype: str, threads: int = 0) -> None:
        import torch

        self.threads = threads
        if threads:
            torch.set_num_threads(threads)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.device = device
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
        )

    def ids(self, q: str) -> Any:
        out = self.tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        return self.torch.tensor(
            [list(out["input_ids"] if hasattr(out, "keys") else out)], device=self.device
        )

    def run(self, prompts: list[str], max_tokens: int) -> dict[str, Any]:
        """Runs in a worker thread, as the server's scheduler does: on a loaded machine torch's
        CPU threads behave very differently in the main thread (measured 0.8 vs 4 tokens/s for
        the same generate), and the comparison must not hinge on that."""
        out: dict[str, Any] = {}

        def work() -> None:
            if self.threads:
                self.torch.set_num_threads(self.threads)
            out.update(self._run(prompts, max_tokens))

        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        return out

    def _run(self, prompts: list[str], max_tokens: int) -> dict[str, Any]:
        from transformers.generation.streamers import BaseStreamer

        torch, device = self.torch, self.device

        class Clock(BaseStreamer):
            def __init__(self) -> None:
                self.times: list[float] = []
                self.first = True

            def put(self, value: Any) -> None:
                if self.first:  # generate first hands over the prompt
                    self.first = False
                    return
                if device != "cpu":
                    torch.cuda.synchronize()
                self.times.append(time.perf_counter())

            def end(self) -> None:
                pass

        ttft, itl, tokens = [], [], 0
        start = time.perf_counter()
        for q in prompts:
            clock = Clock()
            ids = self.ids(q)
            t0 = time.perf_counter()
            out = self.model.generate(
                ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, streamer=clock
            )
            tokens += out.shape[1] - ids.shape[1]
            ttft.append(clock.times[0] - t0)
            itl += [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
        wall = time.perf_counter() - start
        return {"tokens": tokens, "wall": wall, "ttft": ttft, "itl": itl, "requests": len(prompts)}


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "tokens": sum(p["tokens"] for p in parts),
        "wall": sum(p["wall"] for p in parts),
        "ttft": [x for p in parts for x in p["ttft"]],
        "itl": [x for p in parts for x in p["itl"]],
        "requests": sum(p["requests"] for p in parts),
    }


# --- the server ----------------------------------------------------------------------------------
async def one_request(
    client: httpx.AsyncClient, url: str, key: str, model: str, q: str, max_tokens: int
) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": q}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    from services.common.openai_stream import openai_chunks
    from services.common.openai_wire import ChatCompletionChunk

    t0 = time.perf_counter()
    times: list[float] = []
    usage = prompt = 0
    async with client.stream(
        "POST", url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        resp.raise_for_status()
        async for chunk in openai_chunks(resp.aiter_lines(), ChatCompletionChunk):
            if chunk.usage is not None:
                usage, prompt = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
            times += [time.perf_counter() for choice in chunk.choices if choice.text]
    ttft = times[0] - t0 if times else float("nan")
    return {"ttft": ttft, "times": times, "tokens": usage, "prompt_tokens": prompt}


async def load(
    url: str,
    key: str,
    model: str | list[str],
    concurrency: int,
    per_stream: int,
    max_tokens: int,
    question: Callable[[int], str] = unique_question,
) -> dict[str, Any]:
    """``model`` may list several names: stream w uses ``model[w % len(model)]``; ``question``
    makes request i's user message."""
    models = [model] if isinstance(model, str) else model
    results: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=600) as client:

        async def worker(w: int) -> None:
            for r in range(per_stream):
                q = question(w * per_stream + r)
                name = models[w % len(models)]
                results.append(await one_request(client, url, key, name, q, max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.perf_counter() - start
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:], strict=False)]
    return {
        "tokens": sum(r["tokens"] for r in results),
        "wall": wall,
        "ttft": [r["ttft"] for r in results],
        "itl": itl,
        "requests": len(results),
    }


def start_server(
    model_dir: Path,
    home: Path,
    redis_url: str,
    device: str,
    dtype: str,
    max_batch: int,
    chunk: int,
    threads: int,
    prefix_cache_mb: float = 64.0,
    extra_env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    from benchmarks.agent.stack import free_port, service_env, uvicorn_command

    port = free_port()
    env = service_env(
        home,
        redis_url,
        TANDEM_LOG_LEVEL="WARNING",
        TANDEM_DEVICE=device,
        TANDEM_INFERENCE_MODEL=str(model_dir),
        TANDEM_INFERENCE_SERVED_MODEL_NAME="bench",
        TANDEM_INFERENCE_DTYPE=dtype,
        TANDEM_INFERENCE_MAX_BATCH_SIZE=str(max_batch),
        TANDEM_INFERENCE_PREFILL_CHUNK=str(chunk),
        TANDEM_INFERENCE_MAX_QUEUE="256",
        TANDEM_INFERENCE_THREADS=str(threads),
        TANDEM_INFERENCE_PREFIX_CACHE_MB=str(prefix_cache_mb),
        # the C++ decode kernels, or a failed start-up: auto would log a failed build and measure
        # the Python loop
        TANDEM_INFERENCE_NATIVE_DECODE="on",
    )
    env.update(extra_env or {})
    proc = subprocess.Popen(uvicorn_command("inference", port), env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the inference server exited during start-up")
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the inference server did not become ready")


def row(name: str, res: dict[str, Any], base: dict[str, Any] | None) -> str:
    """A table row; with ``base`` (a reference run) the tokens/s and TTFT p50 ratios to it."""
    tps = res["tokens"] / res["wall"]
    ratio = ttft_ratio = "1.00x"
    if base is not None:
        ratio = f"{tps / (base['tokens'] / base['wall']):.2f}x"
        ttft_ratio = f"{pct(res['ttft'], 0.5) / pct(base['ttft'], 0.5):.2f}x"
    ms = lambda v: f"{v * 1000:.0f}"  # noqa: E731
    return (
        f"| {name} | {res['requests']} | {res['tokens']} | {tps:.1f} | {ratio} | "
        f"{ms(pct(res['ttft'], 0.5))} / {ms(pct(res['ttft'], 0.95))} | {ttft_ratio} | "
        f"{ms(pct(res['itl'], 0.5))} / {ms(pct(res['itl'], 0.95))} |"
    )


ENGINES = ("generate", "llamacpp-raw", "torch", "llamacpp")


def cpu_line() -> str:
    """The CPU model, its cores here and the features the forward plan reads."""
    from services.common.platforms import cpu_model
    from services.common.platforms.cpu import cpu_features

    f = cpu_features()
    bf16 = "AMX" if f.amx_usable else "AVX512-BF16" if f.avx512_bf16 else "no native bf16"
    vnni = ", AVX512-VNNI" if f.avx512_vnni else ""
    return f"{cpu_model()}, {os.cpu_count()} cores, torch {f.capability}, {bf16}{vnni}"


def served_plan(url: str, key: str) -> str:
    """The forward plan the server resolved (its /health), in one line."""
    health = httpx.get(url + "/health", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()
    plan = health.get("forward_plan")
    if not plan:
        return f"engine {health.get('engine')} (no forward plan)"
    fields = (
        "decode",
        "prompt",
        "layer_decode",
        "layer_prompt",
        "head_decode",
        "head_prompt",
        "attention",
        "kv_dtype",
    )
    return "forward plan " + " ".join(f"{k}={plan.get(k)}" for k in fields)


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def make_lora(model_dir: Path, target: Path) -> Path:
    """A random rank-8 PEFT LoRA adapter on the trainer's default targets (random B too, so it
    changes the outputs as a trained one does)."""
    from tests.helpers.models import make_lora_adapter

    if (target / "adapter_config.json").is_file():
        return target
    return make_lora_adapter(
        model_dir, target, 0, modules=["q_proj", "k_proj", "v_proj", "o_proj"], b_std=0.02
    )


def load_adapter(url: str, key: str, name: str, path: Path) -> None:
    resp = httpx.post(
        url + "/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(path)},
        headers={"Authorization": f"Bearer {key}"},
        timeout=600,
    )
    resp.raise_for_status()


def raw_prompts(
    tokenizer: Any,
    streams: int,
    per_stream: int,
    offset: int,
    question: Callable[[int], str] = unique_question,
) -> list[list[list[int]]]:
    """The same kind of chat prompts the server gets, as token ids, per stream."""
    return [
        [chat_ids(tokenizer, question(offset + w * per_stream + r)) for r in range(per_stream)]
        for w in range(streams)
    ]


PREFILL_TEXT = " ".join(QUESTIONS)


def long_prompt(tokenizer: Any, tokens: int, i: int) -> tuple[str, list[int]]:
    """A user message whose chat prompt is about ``tokens`` tokens, and those token ids: a
    number no other prompt of the run starts with (so no prefix cache reuses more than the
    template's opening), then text repeated to length."""
    head = f"Document {i}. "
    body = tokenizer(PREFILL_TEXT, add_special_tokens=False)["input_ids"]
    overhead = len(chat_ids(tokenizer, head))
    need = max(tokens - overhead, 1)
    text = head + tokenizer.decode((body * (need // len(body) + 1))[:need])
    return text, chat_ids(tokenizer, text)


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return [int(x) for x in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


async def server_prefill(url: str, key: str, text: str) -> tuple[int, float]:
    """(prompt tokens, seconds to the first token) of one request with one token to make."""
    async with httpx.AsyncClient(timeout=600) as client:
        res = await one_request(client, url, key, "bench", text, 1)
    return res["prompt_tokens"], res["ttft"]


def print_prefill(prefills: list[tuple[str, float, float | None]], tokens: int, requests: int) -> None:
    """Prefill tokens/s per run, and against the same round's llama.cpp where it ran."""
    import statistics

    print()
    print(f"Prefill: one {tokens}-token prompt at a time, median of {requests} requests per run")
    print()
    print("| run | prefill tokens/s | vs llama.cpp |")
    print("| --- | ---: | ---: |")
    by_run: dict[str, list[float]] = {}
    for label, tps, ref in prefills:
        ratio = f"{tps / ref:.2f}x" if ref else "-"
        print(f"| {label} | {tps:.0f} | {ratio} |")
        if ref and ", round " in label:
            by_run.setdefault(label.rsplit(", round ", 1)[0], []).append(tps / ref)
    for run, ratios in by_run.items():
        print(
            f"| {run}: median over rounds | | {statistics.median(ratios):.2f}x "
            f"({' / '.join(f'{x:.2f}' for x in ratios)}) |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--model",
        default="",
        help="HF folder or .gguf (default: SmolLM2-135M-Instruct on cpu, a random Llama-3.2-1B shape on cuda)",
    )
    ap.add_argument(
        "--engines",
        default="",
        help=f"comma-separated, from {', '.join(ENGINES)} (default: all; the llama.cpp ones where "
        "llama-cpp-python is installed and the model is a GGUF file)",
    )
    ap.add_argument(
        "--concurrency",
        default="",
        help="comma-separated stream counts (default 1,4,16 on cpu; 1,16,64 on cuda)",
    )
    ap.add_argument(
        "--dtype",
        default="",
        choices=["", "float32", "bfloat16"],
        help="weights of the torch server and the baseline (default: float32 on cpu, bfloat16 on cuda)",
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--per-stream",
        type=int,
        default=0,
        help="requests each stream sends (default: 4 at C=1, 3 at C=4, 2 at C>=16)",
    )
    ap.add_argument("--baseline-requests", type=int, default=2, help="baseline requests before each level")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument(
        "--prefill-tokens",
        type=int,
        default=1500,
        help="also time the prefill of prompts this long, one at a time (0: not); llama.cpp's and the "
        "servers', interleaved by round as the decode levels are",
    )
    ap.add_argument("--prefill-requests", type=int, default=3, help="prompts per prefill run (median)")
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="the decode levels' prompts this long (a RAG answer's context, e.g. 1500) instead of short "
        "questions: decode then reads a long KV cache",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads of every engine: torch's (baseline and torch server) and llama.cpp's "
        "(0: torch's default, all cores for llama.cpp); on a machine shared with other jobs, 1 gives "
        "stable figures",
    )
    ap.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=64.0,
        help="the server's prefix cache (TANDEM_INFERENCE_PREFIX_CACHE_MB); 0 turns it off for an A/B run",
    )
    ap.add_argument(
        "--raw-requantize",
        default="none",
        choices=["none", "q8_0", "q4_0"],
        help="llamacpp-raw also runs the file re-quantised so (what the llamacpp engine serves by default: "
        "q8_0); the reference stays the file as it is",
    )
    ap.add_argument(
        "--lora-half",
        action="store_true",
        help="Tandem engines also run every level with a (random) LoRA adapter on half the streams",
    )
    ap.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra server setting for an A/B run, e.g. TANDEM_INFERENCE_ADMIT_WINDOW_MS=0 (repeatable)",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=[TANDEM_INFERENCE_X=V,...]",
        help="compare server configurations instead of the transformers baseline (repeatable; "
        "see benchmarks/inference/variants.py), e.g. int4=TANDEM_INFERENCE_QUANTIZE=int4",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds (medians): of --variant runs; and, with llamacpp-raw beside one Tandem "
        "server, llama.cpp's levels then the server's, this many times (the machine's drift falls on both)",
    )
    args = ap.parse_args()
    bad = [e for e in args.server_env if "=" not in e or not e.startswith("TANDEM_INFERENCE_")]
    if bad:
        ap.error(f"--server-env wants TANDEM_INFERENCE_NAME=VALUE, got {bad[0]!r}")
    extra_env = dict(e.split("=", 1) for e in args.server_env)
    if not 0 <= args.prompt_tokens <= 2000 - args.max_tokens:
        ap.error(
            f"--prompt-tokens: {args.prompt_tokens} and {args.max_tokens} new tokens exceed the 2,048-token context"
        )
    if not 0 <= args.prefill_tokens <= 2000:
        ap.error(
            f"--prefill-tokens: {args.prefill_tokens} is not in 0-2000 (the server's 2,048-token context)"
        )
    engines = [e for e in (args.engines or ",".join(ENGINES)).split(",") if e]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        ap.error(f"--engines: unknown {unknown[0]!r}; choose from {', '.join(ENGINES)}")

    from services.inference.engine.loader import default_gguf_path, resolve_model
    from tests.helpers.models import MODEL_CACHE, smollm2_dir
    from tests.helpers.servers import valkey_server

    gguf: Path | None = None
    if args.model.endswith(".gguf"):
        gguf = Path(args.model)
    elif not args.model and args.device == "cpu":
        gguf = default_gguf_path()
    llama_ones = [e for e in engines if e.startswith("llamacpp")]
    missing = "llama-cpp-python is not installed" if not llama_cpp_available() else None
    missing = missing or ("the model is not a GGUF file" if gguf is None else None)
    if llama_ones and missing:
        if args.engines:
            ap.error(f"--engines {','.join(llama_ones)}: {missing} (pip install -e '.[llamacpp]')")
        print(f"note: leaving out {', '.join(llama_ones)}: {missing}", flush=True)
        engines = [e for e in engines if not e.startswith("llamacpp")]

    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    levels = [
        int(x) for x in (args.concurrency or ("1,4,16" if args.device == "cpu" else "1,16,64")).split(",")
    ]
    per_level = {c: args.per_stream or (4 if c == 1 else 3 if c <= 4 else 2) for c in levels}
    # (label, result, reference label); the reference is llama.cpp's single stream when it ran
    results: list[tuple[str, dict[str, Any], dict[str, Any] | None]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        if args.model:
            model_dir = resolve_model(args.model, MODEL_CACHE)
        elif args.device == "cuda":
            model_dir = llama_1b_folder(MODEL_CACHE / "random-llama-3.2-1b-shape", smollm2_dir())
        else:
            model_dir = smollm2_dir()
        print(
            f"model {model_dir.name} on {args.device} ({dtype}), {args.max_tokens} tokens per request, "
            f"engines {', '.join(engines)}",
            flush=True,
        )
        print(f"CPU: {cpu_line()}", flush=True)
        if args.variant:
            from benchmarks.inference.variants import compare

            return compare(args, model_dir, tmpdir, dtype, levels, extra_env)
        reference: dict[str, Any] | None = None
        raws: list[tuple[str, Any]] = []
        servers = [e for e in engines if e in ("torch", "llamacpp")]
        # llama.cpp's levels between the server's rounds (see --rounds): one server only, so
        # every round compares the two a minute apart
        contender_rounds = args.rounds if "llamacpp-raw" in engines and len(servers) == 1 else 1
        tokenizer = None
        if "llamacpp-raw" in engines:
            from transformers import AutoTokenizer

            from benchmarks.inference.llamacpp_raw import LlamaCppRaw

            assert gguf is not None
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            files = [("", gguf)]
            if args.raw_requantize != "none":
                from services.inference.engine.llamacpp_engine import requantized

                # what the llamacpp engine serves by default: the same file re-quantised
                kind = args.raw_requantize
                files.append((f", the file re-quantised to {kind}", requantized(gguf, kind, MODEL_CACHE)))
            for what, path in files:
                raw = LlamaCppRaw(
                    path,
                    threads=args.threads or os.cpu_count() or 1,
                    max_seqs=max(levels),
                    n_ctx_per_seq=max(1024, args.prompt_tokens + args.max_tokens + 64),
                )
                raw.run(raw_prompts(tokenizer, 1, 1, 10_000), 4)  # warm-up
                raws.append((what, raw))
        if (args.prefill_tokens or args.prompt_tokens) and servers and tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # the decode levels' user messages: short questions, or RAG-length prompts (--prompt-tokens)
        long_numbers = itertools.count(100_000)

        def long_question(_i: int) -> str:
            return long_prompt(tokenizer, args.prompt_tokens, next(long_numbers))[0]

        question: Callable[[int], str] = long_question if args.prompt_tokens else unique_question
        prefills: list[tuple[str, float, float | None]] = []
        prefill_numbers = itertools.count(60_000)
        prefill_raw = None
        if args.prefill_tokens and raws:
            assert gguf is not None
            # a context of its own: the decode one holds max(levels) sequences of 1,024 tokens
            prefill_raw = LlamaCppRaw(
                gguf,
                threads=args.threads or os.cpu_count() or 1,
                max_seqs=1,
                n_ctx_per_seq=args.prefill_tokens + 64,
            )
            prefill_raw.prefill(long_prompt(tokenizer, args.prefill_tokens, next(prefill_numbers))[1])
        # the last llama.cpp prefill: the reference of the server's prefill in the same round
        prefill_ref: list[float | None] = [None]

        def prefill_rates(one: Any) -> float:
            """Median prefill tokens/s of --prefill-requests new long prompts; ``one`` maps a
            prompt (text, ids) to (prompt tokens, seconds)."""
            import statistics

            rates = []
            for _ in range(args.prefill_requests):
                n, secs = one(long_prompt(tokenizer, args.prefill_tokens, next(prefill_numbers)))
                rates.append(n / secs)
            return statistics.median(rates)

        def run_raw(tag: str) -> dict[str, Any] | None:
            """llama.cpp's levels; returns this round's single stream (the reference)."""
            first: dict[str, Any] | None = None
            for what, raw in raws:
                for c in sorted(levels):
                    print(f"llama.cpp{what}{tag}: {c} streams x {per_level[c]} requests ...", flush=True)
                    prompts = raw_prompts(tokenizer, c, per_level[c], 20_000 + 100 * c, question)
                    res = raw.run(prompts, args.max_tokens)
                    if c == 1 and first is None:
                        first = res
                    results.append((f"llama.cpp (llama-cpp-python){what}, {c} streams{tag}", res, first))
            if prefill_raw is not None:
                print(f"llama.cpp{tag}: prefill of {args.prefill_tokens}-token prompts ...", flush=True)
                tps = prefill_rates(lambda p: (len(p[1]), prefill_raw.prefill(p[1])))
                prefills.append((f"llama.cpp (llama-cpp-python){tag}", tps, None))
                prefill_ref[0] = tps
            return first

        if raws and contender_rounds == 1:
            reference = run_raw("")
        base_model = Baseline(model_dir, args.device, dtype, args.threads) if "generate" in engines else None
        if base_model is not None:
            base_model.run(QUESTIONS[:1], 4)  # warm-up
            if reference is not None or not servers:
                prompts = [unique_question(50_000 + j) for j in range(args.baseline_requests)]
                print(f"baseline: sequential generate of {len(prompts)} requests ...", flush=True)
                base = base_model.run(prompts, args.max_tokens)
                results.append(("transformers generate, sequential", base, reference))
        with valkey_server(tmpdir / "valkey") as redis_url:
            import redis

            from services.common.auth import KeyStore

            rc = redis.Redis.from_url(redis_url, decode_responses=True)
            key = KeyStore(rc).create("bench", operator=True)[0]
            adapter = (
                make_lora(model_dir, tmpdir / "home" / "models" / "bench-lora") if args.lora_half else None
            )
            for engine in servers:
                env = {**extra_env, "TANDEM_INFERENCE_ENGINE": engine}
                served = model_dir if engine == "torch" else gguf
                assert served is not None
                proc, url = start_server(
                    served,
                    tmpdir / "home",
                    redis_url,
                    args.device,
                    dtype,
                    max(levels),
                    args.prefill_chunk,
                    args.threads,
                    args.prefix_cache_mb,
                    env,
                )
                try:
                    asyncio.run(load(url, key, "bench", 1, 1, 8))  # warm-up
                    if args.prefill_tokens or args.prompt_tokens:
                        # a first long prompt's one-off costs (new product and attention shapes,
                        # the KV slab's first pages) are not the steady state's
                        text = long_prompt(tokenizer, max(args.prefill_tokens, args.prompt_tokens), 99_999)[0]
                        asyncio.run(server_prefill(url, key, text))
                    print(f"{engine} server: {served_plan(url, key)}", flush=True)
                    # the registry is durable and shared by the servers of this run: a name each
                    lora = f"bench-lora-{engine}"
                    if adapter is not None:
                        load_adapter(url, key, lora, adapter)
                        asyncio.run(load(url, key, lora, 1, 1, 8))
                    for r in range(contender_rounds):
                        tag = f", round {r + 1}" if contender_rounds > 1 else ""
                        if contender_rounds > 1:
                            reference = run_raw(tag)
                        for i, c in enumerate(levels):
                            base = reference
                            if base is None and base_model is not None:
                                # the baseline runs right before each level: on a shared machine the
                                # load drifts, so each ratio compares figures taken a minute apart
                                prompts = [unique_question(i * 5 + j) for j in range(args.baseline_requests)]
                                print(
                                    f"baseline: sequential generate of {len(prompts)} requests ...",
                                    flush=True,
                                )
                                base = base_model.run(prompts, args.max_tokens)
                                results.append(
                                    (f"transformers generate, sequential (before {c})", base, None)
                                )
                            print(
                                f"{engine} server{tag}: {c} concurrent streams x {per_level[c]} requests ...",
                                flush=True,
                            )
                            res = asyncio.run(
                                load(url, key, "bench", c, per_level[c], args.max_tokens, question)
                            )
                            results.append((f"tandem {engine} engine, {c} streams{tag}", res, base))
                            if adapter is not None:
                                models = ["bench", lora] if c > 1 else [lora]
                                label = "LoRA on half the streams" if c > 1 else "LoRA"
                                print(f"{engine} server{tag}: {c} streams, {label} ...", flush=True)
                                res = asyncio.run(
                                    load(url, key, models, c, per_level[c], args.max_tokens, question)
                                )
                                results.append(
                                    (f"tandem {engine} engine, {c} streams, {label}{tag}", res, base)
                                )
                        if args.prefill_tokens:
                            print(
                                f"{engine} server{tag}: prefill of {args.prefill_tokens}-token prompts ...",
                                flush=True,
                            )
                            tps = prefill_rates(lambda p, u=url: asyncio.run(server_prefill(u, key, p[0])))
                            prefills.append((f"tandem {engine} engine{tag}", tps, prefill_ref[0]))
                finally:
                    proc.terminate()
                    proc.wait(30)
    what = "llama.cpp 1 stream" if reference is not None else "generate"
    print()
    print(
        f"| run | requests | tokens | tokens/s | vs {what} | TTFT p50 / p95 ms | TTFT p50 vs {what} | "
        "ITL p50 / p95 ms |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, res, base in results:
        print(row(label, res, base))
    if contender_rounds > 1:
        print_round_medians(results, contender_rounds)
    if prefills:
        print_prefill(prefills, args.prefill_tokens, args.prefill_requests)
    for _, raw in raws:
        raw.close()
    if prefill_raw is not None:
        prefill_raw.close()
    return 0


def print_round_medians(
    results: list[tuple[str, dict[str, Any], dict[str, Any] | None]], rounds: int
) -> None:
    """Per run (label without its round): the median over the rounds of its tokens/s ratio and
    TTFT p50 ratio, each round's ratio against that round's llama.cpp single stream."""
    import statistics

    by_run: dict[str, list[tuple[float, float, float]]] = {}
    for label, res, base in results:
        if base is None or ", round " not in label:
            continue
        run = label.rsplit(", round ", 1)[0]
        tps = res["tokens"] / res["wall"]
        ratio = tps / (base["tokens"] / base["wall"])
        ttft = pct(res["ttft"], 0.5)
        by_run.setdefault(run, []).append((ratio, ttft, ttft / pct(base["ttft"], 0.5)))
    print()
    print(f"Medians over {rounds} rounds (each against its own round's llama.cpp single stream):")
    print()
    print("| run | tokens/s vs llama.cpp 1 stream | rounds | TTFT p50 ms | TTFT p50 vs llama.cpp |")
    print("| --- | ---: | --- | ---: | ---: |")
    for run, vals in by_run.items():
        ratios = [v[0] for v in vals]
        print(
            f"| {run} | {statistics.median(ratios):.2f}x | {' / '.join(f'{x:.2f}' for x in ratios)} | "
            f"{statistics.median(v[1] for v in vals) * 1000:.0f} | {statistics.median(v[2] for v in vals):.2f}x |"
        )


if __name__ == "__main__":
    sys.exit(main())
