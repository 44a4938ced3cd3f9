"""One decode step of the torch engine's model runner, in process (no HTTP, no scheduler).

Times ``ModelRunner.forward`` on decode rows only, at several row counts, for each variant of
the runner's settings, the variants interleaved round by round (the machine's drift falls on
all of them alike). Prints the median step per variant and row count, and its ratio against the
first variant.

    python -m benchmarks.inference.step                                  # lean vs eager decode
    python -m benchmarks.inference.step --rows 1,4,16 --rounds 5 --threads 2
    python -m benchmarks.inference.step --profile lean                   # top ATen ops of a 1-row step
    python -m benchmarks.inference.step --head --rows 1,4,16             # the output head's kernels alone
    python -m benchmarks.inference.step --int4 --rows 1,16,256           # a layer's products alone, by kernel
    python -m benchmarks.inference.step --prompts 1,16 --lora            # prompt forwards: lean vs eager
    python -m benchmarks.inference.step --dtype bfloat16 --variants python,lean  # a bf16 model's own weights
    python -m benchmarks.inference.step --variants lean,lean-f16-kv --context 1500  # fp32 vs fp16 KV cache

``--dtype bfloat16``: the model loaded in bf16 (as downloaded from a hub) and decoded with its own
weights (no quantisation: int4 decode is an fp32 model's), oneDNN's bf16 products in every variant.

``--prompts N,..``: instead of decode steps, one prompt forward of N prompts of 16 new tokens each
after a cached 26-token prefix (a burst of chat requests: SmolLM2's template shares 26 tokens), for
the prompt paths ``PROMPT_VARIANTS`` (the lean prompt forward in C++ and in Python with the probe's
blocks, in Python with 64-row blocks only, and the eager forward), interleaved round by round; ``--lora`` adds the same burst with
half its prompts (a lone prompt: it) on a random rank-8 q/k/v/o adapter.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from services.inference.engine.plan import plan_for

# lean: the lean decode forward with its C++ loop (the plan's int4 kernel: Q4_1 x int8 rows where
# the C++ module is built); lean-torch-int4: the same with torch's int4 kernel (bf16 rows); python:
# its Python loop (no C++ kernels, so no Q8_0 head nor C++ prompt layers either); eager: HF's modules;
# lean-f16-kv: lean with the keys and values stored in fp16 (TANDEM_INFERENCE_KV_DTYPE=float16);
# lean-fp16-mult: lean with every int4 weight's scales as fp16 multipliers (5.25 bits a weight,
# where a Q4_K file's take int8 ones: 4.75)
VARIANTS: dict[str, dict[str, bool]] = {
    "lean": {"fused": True, "native": True, "own_int4": True},
    "lean-fp16-mult": {"fused": True, "native": True, "own_int4": True, "fp16_mult": True},
    "lean-f16-kv": {"fused": True, "native": True, "own_int4": True, "f16_kv": True},
    "lean-torch-int4": {"fused": True, "native": True, "own_int4": False},
    "python": {"fused": True, "native": False, "own_int4": False},
    "eager": {"fused": False, "native": False, "own_int4": False},
}


# prompt paths (--prompts): the lean prompt forward in C++ (native) or Python, with bf16 blocks of
# at most this many rows (64: the blocks where the probe finds no larger ones), and the Hugging Face
# modules' forward: (lean forward, its C++ loop, largest block)
PROMPT_VARIANTS: dict[str, tuple[bool, bool, int]] = {
    "native": (True, True, 192),
    "lean": (True, False, 192),
    "lean-64": (True, False, 64),
    "eager": (False, False, 192),
}


def load(model: str | None, threads: int) -> tuple[Any, Path]:
    """The tokenizer and folder of ``model`` (the default model's, converted once)."""
    from transformers import AutoTokenizer

    from services.common.config import CommonSettings
    from services.inference.engine.loader import resolve_model
    from services.inference.engines import cache_root

    torch.set_num_threads(threads)
    path = resolve_model(model, cache_root(CommonSettings()))  # type: ignore[call-arg]
    return AutoTokenizer.from_pretrained(path), path


def runner_for(
    path: Path,
    name: str,
    slots: int,
    adapter: Path | None,
    dtype: torch.dtype = torch.float32,
    max_model_len: int = 512,
) -> Any:
    """A runner of its own model (a loaded adapter wraps the model it is loaded into): an fp32 model
    decoding in int4, or a bf16 one with its own weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.inference.engine import TorchEngine
    from services.inference.engine.quantized_linear import Int4Blocks

    variant = VARIANTS[name]
    Int4Blocks.multipliers = "fp16" if variant.get("fp16_mult") else None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    quantize = "int4" if dtype == torch.float32 else "none"
    plan = plan_for(
        model,
        quantize=quantize,
        native_decode="on" if variant["native"] else "off",
        kv_dtype="float16" if variant.get("f16_kv") else "model",
    )
    if not variant["fused"]:
        plan = dataclasses.replace(plan, decode="reference")
    if not variant["own_int4"] and plan.layer_decode == "int4-q8":
        plan = dataclasses.replace(plan, layer_decode="int4")
    engine = TorchEngine.from_model(
        model,
        AutoTokenizer.from_pretrained(path),
        max_batch_size=slots,
        max_model_len=max_model_len,
        plan=plan,
    )
    if adapter is not None:
        engine.load_adapter_sync("lora", str(adapter))
    engine.runner.prepare_weights()
    return engine.runner


def fill(runner: Any, slots: int, prompt: list[int]) -> None:
    from services.inference.engine.ragged import PrefillRow

    for slot in range(slots):
        runner.forward([], [PrefillRow(slot=slot, token_ids=prompt, start=0)])


def step_ms(runner: Any, rows: int, position: int, steps: int, lora: bool = False) -> float:
    """Median ms of ``steps`` decode steps of ``rows`` rows (with ``lora``, odd slots' rows
    through the adapter)."""
    from services.inference.engine.ragged import DecodeRow

    times = []
    for i in range(steps):
        decode = [
            DecodeRow(
                slot=s,
                token=100 + s,
                position=position + i,
                adapter="lora" if lora and (s % 2 or rows == 1) else None,
            )
            for s in range(rows)
        ]
        start = time.perf_counter()
        runner.forward(decode, [])
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def head(path: Path, rows: list[int], rounds: int, steps: int) -> int:
    """The output head's decode product alone, per kernel and row count (medians over rounds)."""
    from transformers import AutoModelForCausalLM

    from services.common.platforms import cpu_features
    from services.inference.engine import native
    from services.inference.engine.quantized_linear import BF16Packed, Q8Blocks, Q8Rows

    if not native.start("on") or native.q8_linear() is None:
        raise SystemExit("the Q8_0 kernel needs the native module on an AVX2 CPU")
    weight = (
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        .get_output_embeddings()
        .weight.detach()
    )
    kernels: dict[str, Any] = {"Q8_0 blocks (own)": Q8Blocks(), "bf16 oneDNN-packed": BF16Packed(max(rows))}
    if cpu_features().avx512_vnni:
        kernels = {"Q8_0 x int8 rows (own, AVX512-VNNI)": Q8Rows(), **kernels}
    prepared = {name: k.prepare(weight) for name, k in kernels.items()}
    calls = {
        name: (lambda xs, k=kernel, p=prepared[name]: k.apply(xs[0], p, None))
        for name, kernel in kernels.items()
    }
    time_kernels("head kernel", calls, [weight.shape[1]], rows, rounds, steps, unit="ms")
    return 0


def time_kernels(
    title: str, calls: dict[str, Any], widths: list[int], rows: list[int], rounds: int, steps: int, unit: str
) -> None:
    """Print each call's median time (``unit``: ms or us) a row count, medians over rounds; a call
    takes random inputs of ``widths`` columns and that many rows, the calls interleaved."""
    scale = 1000.0 if unit == "ms" else 1e6
    times: dict[tuple[str, int], list[float]] = {}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for _ in range(rounds):
            for r in rows:
                xs = [torch.randn(r, width, generator=gen) for width in widths]
                for name, call in calls.items():
                    samples = []
                    for _ in range(steps):
                        start = time.perf_counter()
                        call(xs)
                        samples.append((time.perf_counter() - start) * scale)
                    times.setdefault((name, r), []).append(statistics.median(samples))
    digits = 2 if unit == "ms" else 0
    print(f"| {title} | {' | '.join(f'{r} rows {unit}' for r in rows)} |")
    print(f"| --- | {' | '.join('---:' for _ in rows)} |")
    for name in calls:
        print(f"| {name} | {' | '.join(f'{statistics.median(times[name, r]):.{digits}f}' for r in rows)} |")


def int4(path: Path, rows: list[int], rounds: int, steps: int) -> int:
    """A decoder layer's four products alone (the first layer's weights side by side as the lean
    forwards multiply them), per kernel and row count (medians over rounds): the int4 kernels decode
    rows take, and at a prompt chunk's rows those prompt rows may take (the int4 blocks, or oneDNN's
    bf16 blocks)."""
    from transformers import AutoModelForCausalLM

    from services.common.platforms import cpu_features
    from services.inference.engine import native, packed_linear
    from services.inference.engine.layer_ops import layer_ops, projection
    from services.inference.engine.quantized_linear import BlockedBF16, Int4Blocks, Int4WeightOnly

    if not native.start("on") or native.q4_linear() is None:
        raise SystemExit("the own int4 kernel needs the native module on an AVX2 CPU")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).model
    ops = layer_ops(model.config, model.layers)
    if isinstance(ops, str):
        raise SystemExit(f"the lean forward does not compute this model's layers: {ops}")
    layer = model.layers[0]
    products = (ops.attention, ("o_proj",), ops.mlp_in, (ops.mlp_out,))  # as fused_decode's _Layer multiplies
    weights = [torch.cat([projection(layer, n).weight.detach() for n in names]) for names in products]
    q4, aten = native.q4_linear(), Int4WeightOnly()
    own = [Int4Blocks().prepare(w) for w in weights]
    # the same values with fp16 multipliers of their scales (5.25 bits a weight; a Q4_K file's
    # take int8 ones by default, 4.75)
    own_fp16 = [Int4Blocks().prepare(w, "fp16") for w in weights]
    theirs = [aten.prepare(w) for w in weights]
    kernels: dict[str, Any] = {
        "Q4_1 x int8 rows, AVX2": lambda xs: [q4(x, *p, wide=False) for x, p in zip(xs, own, strict=True)],
        "torch's int4 kernel, bf16 rows": lambda xs: [
            aten.product(x.bfloat16(), p) for x, p in zip(xs, theirs, strict=True)
        ],
    }
    if cpu_features().avx512_vnni:
        kernels = {
            "Q4_1 x int8 rows, AVX512-VNNI": lambda xs: [
                q4(x, *p, wide=True) for x, p in zip(xs, own, strict=True)
            ],
            "the same, fp16 multipliers": lambda xs: [
                q4(x, *p, wide=True) for x, p in zip(xs, own_fp16, strict=True)
            ],
            **kernels,
        }
    if packed_linear.available(torch.device("cpu"), torch.bfloat16):
        # the other kernel prompt rows may take (PROMPT_DTYPE=bfloat16, what auto picks with AMX)
        blocked = BlockedBF16()
        bf16 = [blocked.prepare(w) for w in weights]
        kernels["bf16 blocks (oneDNN: AMX where usable)"] = lambda xs: [
            blocked.product(blocked.rows(x), p) for x, p in zip(xs, bf16, strict=True)
        ]
    time_kernels(
        "a layer's int4 products", kernels, [w.shape[1] for w in weights], rows, rounds, steps, unit="us"
    )
    return 0


def prompts(path: Path, tokenizer: Any, counts: list[int], rounds: int, steps: int, lora: bool) -> int:
    """Prompt forwards of bursts (``--prompts``): the median per prompt path, burst size and
    adapter split, and each path's ratio against the first."""
    from transformers import AutoModelForCausalLM

    from services.inference.engine import TorchEngine, quantized_linear
    from services.inference.engine.ragged import PrefillRow

    adapter = None
    if lora:
        import tempfile

        from benchmarks.inference.__main__ import make_lora

        adapter = make_lora(path, Path(tempfile.mkdtemp()) / "lora")
    runners = {}
    for name, (lean, in_cpp, block) in PROMPT_VARIANTS.items():
        # the probe runs when the weights are prepared: each runner keeps the blocks it found
        quantized_linear.PROMPT_BLOCK_MAX = block
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        plan = plan_for(model, quantize="int4", native_decode="on")
        if not lean:
            plan = dataclasses.replace(plan, prompt="reference")
        elif not in_cpp and plan.prompt == "native":
            plan = dataclasses.replace(plan, prompt="python")
        engine = TorchEngine.from_model(
            model, tokenizer, max_batch_size=max(counts), max_model_len=512, plan=plan
        )
        if adapter is not None:
            engine.load_adapter_sync("lora", str(adapter))
        engine.runner.prepare_weights()
        runners[name] = engine.runner
    ids = [
        tokenizer(f"Request {i}: what is the main finding about topic number {i} in the study?")["input_ids"][
            :16
        ]
        for i in range(max(counts))
    ]
    cases = [(f"{n}", n, False) for n in counts] + ([(f"{n} LoRA", n, True) for n in counts] if lora else [])

    def burst(n: int, half: bool) -> list[Any]:
        return [
            PrefillRow(
                slot=s, token_ids=ids[s], start=26, adapter="lora" if half and (s % 2 or n == 1) else None
            )
            for s in range(n)
        ]

    results: dict[tuple[str, str], list[float]] = {}
    with torch.inference_mode():
        for runner in runners.values():
            for _, n, half in cases:
                runner.forward([], burst(n, half))  # warm-up
        for _ in range(rounds):
            for name, runner in runners.items():
                for label, n, half in cases:
                    samples = []
                    for _ in range(steps):
                        start = time.perf_counter()
                        runner.forward([], burst(n, half))
                        samples.append((time.perf_counter() - start) * 1000)
                    results.setdefault((name, label), []).append(statistics.median(samples))
    labels = [c[0] for c in cases]
    first = next(iter(runners))
    print(
        f"| prompt path | {' | '.join(f'{c} prompts ms' for c in labels)} | {' | '.join(f'{c} vs {first}' for c in labels)} |"
    )
    print(f"| --- | {' | '.join('---:' for _ in labels * 2)} |")
    for name in runners:
        med = [statistics.median(results[name, c]) for c in labels]
        base = [statistics.median(results[first, c]) for c in labels]
        ratios = [f"{b / m:.2f}x" for m, b in zip(med, base, strict=True)]
        print(f"| {name} | {' | '.join(f'{m:.1f}' for m in med)} | {' | '.join(ratios)} |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model folder or .gguf (default: the default model)")
    ap.add_argument("--variants", default="lean,eager", help=f"of {sorted(VARIANTS)}")
    ap.add_argument("--rows", default="1,16", help="decode rows a step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16, help="timed steps a round (their median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--context",
        type=int,
        default=64,
        help="tokens each slot holds before the timed steps (a RAG prompt: 1500; attention grows with it)",
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the model's dtype: float32 decodes in int4, bfloat16 with the model's own bf16 weights",
    )
    ap.add_argument("--profile", default=None, help="a variant: print its 1-row step's top ops")
    ap.add_argument(
        "--lora",
        action="store_true",
        help="each row count also with a random rank-8 adapter (q/k/v/o) on half the rows (the odd slots; "
        "at 1 row, on that row)",
    )
    ap.add_argument(
        "--head",
        action="store_true",
        help="instead: the output head's decode kernels alone (Q8_0 blocks vs bf16 oneDNN-packed)",
    )
    ap.add_argument(
        "--int4",
        action="store_true",
        help="instead: a layer's products alone (the own int4 kernel, AVX512-VNNI and AVX2, vs torch's int4 and "
        "oneDNN's bf16 blocks); --rows 64,256 for prompt chunks",
    )
    ap.add_argument(
        "--prompts",
        default=None,
        help="instead: prompt forwards of bursts of these many prompts (16 new tokens each), per prompt path",
    )
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    names = args.variants.split(",")
    tokenizer, path = load(args.model, args.threads)
    if args.head:
        return head(path, rows, args.rounds, args.steps)
    if args.int4:
        return int4(path, rows, args.rounds, args.steps)
    if args.prompts:
        counts = [int(n) for n in args.prompts.split(",")]
        return prompts(path, tokenizer, counts, args.rounds, min(args.steps, 8), args.lora)
    text = tokenizer("The quick brown fox jumps over the lazy dog. ")["input_ids"]
    prompt = (text * (args.context // len(text) + 1))[: args.context]
    slots = max(rows)
    adapter = None
    if args.lora:
        import tempfile

        from benchmarks.inference.__main__ import make_lora

        adapter = make_lora(path, Path(tempfile.mkdtemp()) / "lora")
    dtype = getattr(torch, args.dtype)
    longest = args.context + 8 + args.rounds * args.steps + 128
    runners = {name: runner_for(path, name, slots, adapter, dtype, max(512, longest)) for name in names}
    for name, runner in runners.items():
        print(
            f"{name}: decode={runner.plan.decode} layers={runner.plan.layer_decode} ({runner.plan.reasons['decode']})"
        )
    # (label, rows, lora)
    cases = [(f"{r}", r, False) for r in rows] + ([(f"{r} LoRA", r, True) for r in rows] if args.lora else [])
    with torch.inference_mode():
        for runner in runners.values():
            fill(runner, slots, prompt)
            step_ms(runner, max(rows), len(prompt), 2)  # warm-up
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step_ms(runners[args.profile], 1, len(prompt) + 100, 4)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
            return 0
        results: dict[tuple[str, str], list[float]] = {}
        for round_ in range(args.rounds):
            for name, runner in runners.items():
                for label, r, lora in cases:
                    ms = step_ms(runner, r, len(prompt) + 8 + round_ * args.steps, args.steps, lora)
                    results.setdefault((name, label), []).append(ms)
    labels = [c[0] for c in cases]
    print(
        f"| variant | {' | '.join(f'{c} rows ms' for c in labels)} | "
        f"{' | '.join(f'{c} rows vs {names[0]}' for c in labels)} |"
    )
    print(f"| --- | {' | '.join('---:' for _ in labels * 2)} |")
    for name in names:
        med = [statistics.median(results[name, c]) for c in labels]
        base = [statistics.median(results[names[0], c]) for c in labels]
        cells = [
            f"{m:.2f} ({' / '.join(f'{x:.1f}' for x in results[name, c])})"
            for m, c in zip(med, labels, strict=True)
        ]
        ratios = [f"{b / m:.2f}x" for m, b in zip(med, base, strict=True)]
        print(f"| {name} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
