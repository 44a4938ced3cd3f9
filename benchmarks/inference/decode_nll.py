"""What the decode kernels cost in quality: teacher-forced negative log-likelihood of real text
through the torch engine's decode path, per kernel, on the default model.

Each text (GSM8K questions with their worked answers, ``../shared/data/gsm8k``) is prefilled for
its first 16 tokens; every later token is then fed as a decode row (16 texts a step, as a busy
server decodes) and the log-probability the engine gives the text's next token is kept. Runs:
``fp32`` (no quantisation: the GGUF's values in fp32, oneDNN products), ``int4`` (torch's int4
kernel, bf16 rows), ``int4-q8`` (the engine's own Q4_1 x int8 rows where the C++ module is
built, with the plan's head: Q8_0 times int8 rows where the CPU has AVX512-VNNI; fp32 keys and
values), ``int4-q8-f16-kv`` / ``int4-q8-bf16-kv`` (the same with the keys and values stored in
fp16 / bf16: ``TANDEM_INFERENCE_KV_DTYPE``), ``int4-q8-int8-mult`` (the same with every int4 group's
scale and minimum held as an int8 multiplier of its super-block's base, as a Q4_K file's or a
float model's are, where this Q4_1 file's fp16 ones are kept by default), ``int4-q8-bf16-head`` (the same layers, the head in bf16) and ``q8_0`` (int8 decode: Q8_0 blocks
times int8 rows in every layer and the head, AVX512-VNNI; a Q8_0 file's values exactly). Prints mean NLL, perplexity and how often the engine's top token is the text's.

    python -m benchmarks.inference.decode_nll                 # 32 texts, 96 tokens each
    python -m benchmarks.inference.decode_nll --texts 64 --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.inference.invariance import GSM8K

KINDS = (
    "fp32",
    "int4",
    "int4-q8",
    "int4-q8-f16-kv",
    "int4-q8-bf16-kv",
    "int4-q8-int8-mult",
    "int4-q8-bf16-head",
    "q8_0",
)


def runner(path: Path, kind: str, rows: int) -> Any:
    """A runner of the model with decode rows through ``kind``'s kernels (None: not on this CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.inference.engine import TorchEngine
    from services.inference.engine.plan import KVDType, plain_head, plan_for
    from services.inference.engine.quantized_linear import Int4Blocks

    Int4Blocks.multipliers = "int8" if kind == "int4-q8-int8-mult" else None

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if kind == "fp32":
        plan = plan_for(model, quantize="none")
    elif kind == "q8_0":
        plan = plan_for(model, quantize="int8", native_decode="on")
        if plan.layer_decode != "q8_0-int8":
            return None
    else:
        kv_dtype: KVDType = (
            "float16" if kind == "int4-q8-f16-kv" else "bfloat16" if kind == "int4-q8-bf16-kv" else "model"
        )
        plan = plan_for(model, quantize="int4", native_decode="on", kv_dtype=kv_dtype)
        if kind == "int4" and plan.layer_decode == "int4-q8":
            plan = dataclasses.replace(plan, layer_decode="int4")
        elif kind.startswith("int4-q8") and plan.layer_decode != "int4-q8":
            return None
        if kind == "int4-q8-bf16-head":
            plan = dataclasses.replace(plan, head_decode=plain_head())
    engine = TorchEngine.from_model(
        model, AutoTokenizer.from_pretrained(path), max_batch_size=rows, max_model_len=256, plan=plan
    )
    engine.runner.prepare_weights()
    return engine.runner


def score(run: Any, texts: list[list[int]], rows: int, prefix: int) -> tuple[float, float, int]:
    """Mean NLL of each text's tokens after ``prefix``, the top-1 rate, and the token count."""
    from services.inference.engine.ragged import DecodeRow, PrefillRow

    nll: list[float] = []
    top1: list[bool] = []
    for start in range(0, len(texts), rows):
        batch = texts[start : start + rows]
        for slot, ids in enumerate(batch):
            run.forward([], [PrefillRow(slot=slot, token_ids=ids[:prefix], start=0)])
        for pos in range(prefix, min(map(len, batch)) - 1):
            logits = run.forward(
                [DecodeRow(slot=s, token=ids[pos], position=pos) for s, ids in enumerate(batch)], []
            )
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            for slot, ids in enumerate(batch):
                nll.append(-float(logprobs[slot, ids[pos + 1]]))
                top1.append(int(logprobs[slot].argmax()) == ids[pos + 1])
    return statistics.mean(nll), sum(top1) / len(top1), len(nll)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model folder or .gguf (default: the default model)")
    ap.add_argument("--texts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=96, help="tokens of each text")
    ap.add_argument("--rows", type=int, default=16, help="decode rows a step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"of {', '.join(KINDS)}")
    args = ap.parse_args()
    if GSM8K is None:
        raise SystemExit("needs ../shared/data/gsm8k/train.jsonl beside the project")
    from benchmarks.inference.__main__ import cpu_line
    from benchmarks.inference.step import load

    tokenizer, path = load(args.model, args.threads)
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[: args.texts]]
    texts = [tokenizer(r["question"] + "\n" + r["answer"])["input_ids"][: args.tokens] for r in rows]
    print(f"{path.name}, {len(texts)} GSM8K texts, {args.threads} threads; {cpu_line()}")
    print("| decode kernels | layers / head (plan) | NLL | perplexity | top-1 = the text's | tokens |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for kind in args.kinds.split(","):
        run = runner(path, kind, args.rows)
        if run is None:
            print(f"| {kind} | not on this CPU | | | | |")
            continue
        nll, top1, count = score(run, texts, args.rows, prefix=16)
        kernels = f"{run.plan.layer_decode} / {run.plan.head_decode}"
        print(f"| {kind} | {kernels} | {nll:.4f} | {math.exp(nll):.3f} | {top1:.1%} | {count} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
