"""Batch invariance of the torch engine's greedy decoding on a real model.

For each quantisation mode, one engine decodes N prompts greedily twice: all together with
fillers, ``--batch`` requests at once (the scheduler admits them together, so their prompts
are prefilled in shared, split chunks and they decode side by side), and each prompt alone.
It prints how many prompts' tokens differ between the two, and where the first difference is.
A batch-invariant engine prints 0 for every mode.

    python -m benchmarks.inference.invariance                      # SmolLM2 Q4_1, int4 and none
    python -m benchmarks.inference.invariance --modes int4 --prompts 16 --max-tokens 48
    python -m benchmarks.inference.invariance --modes none --prompt-dtype bfloat16  # bf16 prompt products
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
# ../shared/data beside the project (a worktree one level deeper finds it one level up)
GSM8K = next(
    (
        path
        for root in (REPO_ROOT.parent, REPO_ROOT.parent.parent)
        if (path := root / "shared" / "data" / "gsm8k" / "train.jsonl").is_file()
    ),
    None,
)
# used when the shared data is not there: short chat questions of varied length
FALLBACK = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three fruits.",
    "Explain photosynthesis in one sentence.",
    "hi",
    "Who wrote Hamlet?",
    "Give me a tip for sleeping better.",
    "What is 17 times 3?",
]


@dataclass
class ModeResult:
    mode: str
    prompts: int
    differing: int
    first_difference: list[int | None]  # per prompt: index of the first differing token
    # prompts whose chosen tokens' logprobs are not bit for bit the same (a last-bit difference
    # that has not flipped a token yet)
    logprobs_differing: int
    seconds: float


def questions(count: int) -> list[str]:
    """The first ``count`` GSM8K questions (real prompts of 30-150 tokens), else short ones."""
    if GSM8K is not None:
        with GSM8K.open() as f:
            return [json.loads(line)["question"] for _, line in zip(range(count), f, strict=False)]
    return [FALLBACK[i % len(FALLBACK)] + " " * (i // len(FALLBACK)) for i in range(count)]


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return [int(x) for x in (out["input_ids"] if hasattr(out, "keys") else out)]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure(
    model_dir: Path,
    mode: str,
    prompts: list[list[int]],
    batch: int,
    max_tokens: int,
    threads: int,
    prefix_cache_mb: float,
    prompt_dtype: str = "auto",
    native_decode: str = "on",
) -> ModeResult:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.inference.engine import GenerationOutput, SamplingParams, TorchEngine

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = TorchEngine.from_model(
        model,
        tokenizer,
        max_batch_size=batch,
        quantize=mode,  # type: ignore[arg-type]
        prefix_cache_mb=prefix_cache_mb,
        num_threads=threads,
        prompt_dtype=prompt_dtype,  # type: ignore[arg-type]
        native_decode=native_decode,  # type: ignore[arg-type]
    )
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    fillers = [chat_ids(tokenizer, q) for q in questions(len(prompts) + batch)[len(prompts) :]]
    together: list[GenerationOutput] = []
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        together += engine.generate_batch(group + fillers[: batch - len(group)], greedy)[: len(group)]
    alone = [engine.generate_batch([p], greedy)[0] for p in prompts]
    firsts = [first_difference(a.token_ids, b.token_ids) for a, b in zip(alone, together, strict=True)]
    return ModeResult(
        mode=mode,
        prompts=len(prompts),
        differing=sum(f is not None for f in firsts),
        first_difference=firsts,
        logprobs_differing=sum(a.logprobs != b.logprobs for a, b in zip(alone, together, strict=True)),
        seconds=time.perf_counter() - start,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model folder or .gguf (default: the default model)")
    ap.add_argument("--modes", default="int4,none", help="TANDEM_INFERENCE_QUANTIZE values to compare")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16, help="requests decoded together (max_batch_size)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    ap.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=64.0,
        help="the engine's prefix cache (64: the default; 0: off, every run computes its own prompt)",
    )
    ap.add_argument(
        "--prompt-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="TANDEM_INFERENCE_PROMPT_DTYPE: the dtype prompt tokens multiply in",
    )
    ap.add_argument(
        "--native-decode",
        default="on",
        choices=["on", "off"],
        help="the lean forward's loop in C++ (on: the server's default once built) or in Python",
    )
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from services.inference.engine.loader import resolve_model
    from tests.helpers.models import MODEL_CACHE

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model, MODEL_CACHE)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [chat_ids(tokenizer, q) for q in questions(args.prompts)]
    print(
        f"{model_dir.name}: {len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
        f"{args.max_tokens} greedy tokens, alone vs in a batch of {args.batch}, {args.threads} thread(s), "
        f"prefix cache {args.prefix_cache_mb:g} MB, prompt dtype {args.prompt_dtype}, "
        f"native decode {args.native_decode}"
    )
    for mode in args.modes.split(","):
        r = measure(
            model_dir,
            mode,
            prompts,
            args.batch,
            args.max_tokens,
            args.threads,
            args.prefix_cache_mb,
            args.prompt_dtype,
            args.native_decode,
        )
        print(
            f"quantize={r.mode}: {r.differing} of {r.prompts} prompts' tokens differ "
            f"(first differing token per prompt: {r.first_difference}); "
            f"{r.logprobs_differing} prompts' logprobs differ in any bit [{r.seconds:.0f} s]",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
