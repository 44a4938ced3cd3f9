"""Training throughput: zero-padding packing against padded batches.

``python -m benchmarks.training [--sft-samples 64] [--dpo-pairs 48] [--layers 8] [--hidden 576]``

A SmolLM2-shaped model: SmolLM2-135M's layer (hidden 576, 9 query heads / 3 KV heads,
MLP 1536), tokenizer and 49K vocabulary with tied embeddings, but 8 of its 30 layers so
that it trains in minutes on 2 CPU cores; random weights, fp32. Every contender trains on
the same samples with the same number of optimizer steps (micro-batches are accumulated
into that many steps); the figure is *real* (non-padding) tokens per second of forward +
backward + AdamW step.

SFT (GSM8K train plus the chosen dialogues of HH-RLHF, mixed lengths):
  packed            BFD packs of <= 4096 tokens, FlashMask document mask (kernels), the output
                    head only at label positions (modeling.py)
  padded-16         batches of 16 padded to their longest (transformers DataCollatorWithPadding), SDPA,
                    the plain HF forward (logits at every position) and cross-entropy, as a Trainer does
  fixed-1024        every sample padded to 1024 tokens (the common fixed-length practice), same forward
  trl-sft           TRL's SFTTrainer without packing (batches of 16, its collator pads to the longest;
                    the same tokenized samples and assistant-only labels), timed over ``train()``
DPO (HH-RLHF):
  packed            prompt once + chosen + rejected per pair, shared-question mask, <= 4096 per pack
  padded-8-pairs    batches of 8 pairs = 16 rows (prompt+chosen, prompt+rejected) padded to the
                    longest, the HF forward with logits at every position and the log-softmax
                    gathered at the answer tokens: what TRL's DPOTrainer does by default
                    (``concatenated_forward``, ``use_logits_to_keep=False``)
  padded-8-pairs-label-head
                    the same batches with the head only at the answer tokens (our own stronger
                    baseline: the ratio against it is what shared-prompt packing alone gives)
``--diagnose`` adds packed SFT with per-document SDPA and padded-16 with the label-position head.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from services.trainer.data.formats import parse_dataset, parse_hh_dialogue
from services.trainer.data.packing import pack_pairs, pack_sft, shuffled_bfd
from services.trainer.data.tokenize import IGNORE, PairSample, SFTSample, tokenize_pair, tokenize_sft
from services.trainer.losses import dpo_loss
from services.trainer.modeling import load_causal_lm
from services.trainer.recipes.dpo import pack_pair_logps, padded_pair_batch, padded_pair_logps
from services.trainer.recipes.sft import pack_logps, padded_logps

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def build_model(tmp: Path, hidden: int, layers: int) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from services.inference.engine.loader import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(None, Path(".cache/models")))
    heads = max(hidden // 64, 1)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 3, 1),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    return tmp


def register_per_document_sdpa() -> str:
    """Diagnostic only (``--diagnose``): document-masked attention as one SDPA call per document.

    Registered as another HF attention so the *same* packed batches can be timed with an
    attention whose cost follows the document mask, to separate what packing saves from
    what the CPU FlashMask path costs. The trainer itself always uses ``kernels``.
    """
    import torch.nn.functional as F
    from transformers import AttentionInterface

    def attn(
        module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, **kw: Any
    ) -> tuple[torch.Tensor, None]:
        bounds = kw.get("startend_row_indices")
        ends = sorted(set(bounds[0, 0, :, 0].tolist())) if bounds is not None else [q.shape[2]]
        outs, start = [], 0
        for end in ends:
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, start:end],
                    k[:, :, start:end],
                    v[:, :, start:end],
                    is_causal=True,
                    scale=kw.get("scaling"),
                    enable_gqa=True,
                )
            )
            start = end
        return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None

    AttentionInterface.register("bench_per_document_sdpa", attn)
    return "bench_per_document_sdpa"


def sft_samples(tok: Any, n: int, seed: int) -> list[SFTSample]:
    gsm = parse_dataset((DATA / "gsm8k" / "train.jsonl").read_bytes()).records
    hh_rows = [
        json.loads(x)
        for x in (DATA / "hh-rlhf" / "harmless-base.jsonl").read_text().splitlines()
        if x.strip()
    ]
    hh = []
    for row in hh_rows:
        msgs = parse_hh_dialogue(row["chosen"])
        if msgs and msgs[-1]["role"] == "assistant":
            hh.append(msgs)
    rng = random.Random(seed)
    chosen = [r["messages"] for r in rng.sample(gsm, n // 2)] + rng.sample(hh, n - n // 2)
    rng.shuffle(chosen)
    out = [tokenize_sft(tok, m) for m in chosen]
    return [s for s in out if len(s) <= 1024]


def dpo_pairs(tok: Any, n: int, seed: int) -> list[PairSample]:
    recs = parse_dataset((DATA / "hh-rlhf" / "harmless-base.jsonl").read_bytes()).records
    rng = random.Random(seed)
    pairs = [tokenize_pair(tok, r["prompt"], r["chosen"], r["rejected"]) for r in rng.sample(recs, n)]
    return [p for p in pairs if len(p) <= 4096]


def collate_padded(
    samples: list[SFTSample], idx: list[int], tok: Any, fixed: int | None
) -> dict[str, torch.Tensor]:
    from transformers import DataCollatorWithPadding

    collator = DataCollatorWithPadding(
        tok, padding="max_length" if fixed else "longest", max_length=fixed, return_tensors="pt"
    )
    batch = collator([{"input_ids": samples[i].input_ids} for i in idx])
    labels = torch.full_like(batch["input_ids"], IGNORE)
    for row, i in enumerate(idx):
        lab = samples[i].labels[1:]
        labels[row, : len(lab)] = torch.tensor(lab)
    batch["labels"] = labels
    return dict(batch)


def split_steps(micro: list[Any], steps: int) -> list[list[Any]]:
    per = -(-len(micro) // steps)
    return [micro[i : i + per] for i in range(0, len(micro), per)]


def train(
    model: Any,
    steps: list[list[Any]],
    run_micro: Callable[[Any, int], torch.Tensor],
    count: Callable[[Any], int],
) -> tuple[float, list[float]]:
    """Forward+backward of every micro-batch, one AdamW step per group; returns (total s, per-step real tok/s)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, foreach=False)
    rates = []
    total = 0.0
    for group in steps:
        t0 = time.perf_counter()
        denom = sum(count(m) for m in group)
        for m in group:
            run_micro(m, denom).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        total += dt
        rates.append(sum(real_of(m) for m in group) / dt)
    return total, rates


def real_of(m: Any) -> int:
    return int(m["real"]) if isinstance(m, dict) else int(m.real_tokens)


def full_logits_pair_logps(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL-style padded DPO: logits at every position, log-softmax gathered at the answer tokens,
    summed per row; rows are (chosen..., rejected...)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"]
    mask = labels != IGNORE
    logps = logits.float().log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    sums = (logps * mask).sum(-1)
    n = labels.shape[0] // 2
    return sums[:n], sums[n:]


Result = tuple[float, float, float]


def share(x: float) -> str:
    return "n/a" if x != x else f"{x:.1%}"  # NaN: not measured


def warm_up(*models: Any) -> None:
    """One small untimed forward+backward per model (thread pools, first-call set-up), so the
    contender that happens to run first does not pay for them."""
    for model in models:
        ids = torch.randint(0, 1000, (2, 64))
        model(input_ids=ids).logits.float().mean().backward()
        model.zero_grad(set_to_none=True)


def run_contenders(
    contenders: dict[str, Callable[[], tuple[float, list[float], float]]],
    skip: set[str],
    real: int,
    waste: str,
) -> dict[str, Result]:
    results: dict[str, Result] = {}
    for name, fn in contenders.items():
        if name in skip:
            continue
        t, rates, pad = fn()
        results[name] = (real / t, statistics.median(rates), pad)
        print(
            f"  {name:<28} {real / t:8.0f} tok/s  (median step {statistics.median(rates):8.0f})  {waste} {share(pad):>6}  {t:7.1f} s",
            flush=True,
        )
    return results


def print_table(
    kind: str, results: dict[str, Result], base_name: str, waste: str, also: str | None = None
) -> None:
    base = results.get(base_name)
    other = results.get(also) if also else None
    extra = f" | vs {also}" if also else ""
    print(f"\n| {kind} contender | real tokens/s | median step tok/s | {waste} | vs {base_name}{extra} |")
    print("| --- | ---: | ---: | ---: | ---: |" + (" ---: |" if also else ""))
    for name, (tps, med, pad) in results.items():
        ratio = f"{tps / base[0]:.2f}x" if base else "-"
        ratio2 = (f" | {tps / other[0]:.2f}x" if other else " | -") if also else ""
        print(f"| {name} | {tps:.0f} | {med:.0f} | {share(pad)} | {ratio}{ratio2} |")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sft-samples", type=int, default=64)
    ap.add_argument("--dpo-pairs", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--pack", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", default="", help="comma-separated contenders to skip, e.g. fixed-1024")
    ap.add_argument(
        "--diagnose", action="store_true", help="also time the packed batches with per-document SDPA"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp), args.hidden, args.layers)
        tok = AutoTokenizer.from_pretrained(path)
        packed_model = load_causal_lm(path)
        padded_model = load_causal_lm(path, attn="sdpa")
        warm_up(packed_model, padded_model)
        n_params = sum(p.numel() for p in packed_model.parameters())
        print(
            f"model: llama {args.layers} layers, hidden {args.hidden}, vocab {len(tok)}, {n_params / 1e6:.1f}M params, fp32, {args.threads} threads"
        )

        # ---------------- SFT
        samples = sft_samples(tok, args.sft_samples, args.seed)
        real = sum(len(s) for s in samples)
        plan = shuffled_bfd([len(s) for s in samples], args.pack, seed=args.seed)
        packs = [pack_sft(samples, idx, pad_id=tok.pad_token_id, pad_to_multiple_of=64) for idx in plan]
        # one optimizer step per pack at most: every contender accumulates into as many steps
        n_steps = min(len(packs), -(-len(samples) // 16))
        print(f"SFT: {len(samples)} samples, {real} real tokens, {n_steps} optimizer steps each")

        def packed_sft() -> tuple[float, list[float], float]:
            processed = sum(p.total_tokens for p in packs)

            def run(p: Any, denom: int) -> torch.Tensor:
                logps, _ = pack_logps(packed_model, p)
                return -logps.sum() / denom

            t, rates = train(
                packed_model, split_steps(packs, n_steps), run, lambda p: int((p.labels != IGNORE).sum())
            )
            return t, rates, 1 - real / processed

        def padded_sft(
            fixed: int | None, bs: int, label_head: bool = False
        ) -> Callable[[], tuple[float, list[float], float]]:
            def go() -> tuple[float, list[float], float]:
                order = list(range(len(samples)))
                random.Random(args.seed).shuffle(order)
                batches = []
                for i in range(0, len(order), bs):
                    b = collate_padded(samples, order[i : i + bs], tok, fixed)
                    b["real"] = torch.tensor(int(b["attention_mask"].sum()))
                    batches.append(b)
                processed = sum(int(b["input_ids"].numel()) for b in batches)

                def run(b: dict[str, torch.Tensor], denom: int) -> torch.Tensor:
                    if label_head:
                        logps, _ = padded_logps(padded_model, b)
                        return -logps.sum() / denom
                    # The common practice: the HF forward with padded batches, logits at every
                    # position, summed token loss (so accumulation gives the same token mean).
                    logits = padded_model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
                    return (
                        torch.nn.functional.cross_entropy(
                            logits.flatten(0, 1).float(),
                            b["labels"].flatten(),
                            ignore_index=IGNORE,
                            reduction="sum",
                        )
                        / denom
                    )

                t, rates = train(
                    padded_model,
                    split_steps(batches, n_steps),
                    run,
                    lambda b: int((b["labels"] != IGNORE).sum()),
                )
                return t, rates, 1 - real / processed

            return go

        def trl_sft() -> tuple[float, list[float], float]:
            from datasets import Dataset
            from trl import SFTConfig, SFTTrainer

            data = Dataset.from_list([{"input_ids": s.input_ids, "labels": s.labels} for s in samples])
            cfg = SFTConfig(
                output_dir=str(Path(tmp) / "trl"),
                per_device_train_batch_size=16,
                max_steps=n_steps,
                learning_rate=1e-5,
                lr_scheduler_type="constant",
                packing=False,
                max_length=None,
                report_to="none",
                save_strategy="no",
                logging_strategy="no",
                use_cpu=True,
                dataloader_num_workers=0,
                seed=args.seed,
            )
            # its own copy of the model: the trainer may change settings of the model it is given
            model = load_causal_lm(path, attn="sdpa")
            trainer = SFTTrainer(model=model, args=cfg, train_dataset=data, processing_class=tok)
            t0 = time.perf_counter()
            trainer.train()
            t = time.perf_counter() - t0
            return t, [real / t], float("nan")  # its batches are its own: padding not measured

        def packed_diag() -> tuple[float, list[float], float]:
            nonlocal packed_model
            saved = packed_model
            packed_model = load_causal_lm(path, attn=register_per_document_sdpa())
            try:
                return packed_sft()
            finally:
                packed_model = saved

        contenders = {
            f"packed-{args.pack}": packed_sft,
            **({f"packed-{args.pack}-per-doc-sdpa (diagnostic)": packed_diag} if args.diagnose else {}),
            "padded-16": padded_sft(None, 16),
            **({"padded-16-label-head (diagnostic)": padded_sft(None, 16, True)} if args.diagnose else {}),
            "fixed-1024": padded_sft(1024, 4),
            "trl-sft": trl_sft,
        }
        results = run_contenders(contenders, skip, real, "padding")
        print_table("SFT", results, "padded-16", "padding")

        # ---------------- DPO
        pairs = dpo_pairs(tok, args.dpo_pairs, args.seed)
        real_d = sum(len(p) for p in pairs)
        dplan = shuffled_bfd([len(p) for p in pairs], args.pack, seed=args.seed)
        dpacks = [pack_pairs(pairs, idx, pad_id=tok.pad_token_id, pad_to_multiple_of=64) for idx in dplan]
        d_steps = min(len(dpacks), -(-len(pairs) // 8))
        print(
            f"\nDPO: {len(pairs)} pairs, {real_d} unique tokens (prompt once), {d_steps} optimizer steps each"
        )
        ref = torch.zeros(len(pairs), 2)  # reference log-probs are computed once and cached: not timed

        def packed_dpo() -> tuple[float, list[float], float]:
            processed = sum(p.total_tokens for p in dpacks)

            def run(p: Any, denom: int) -> torch.Tensor:
                c, r = pack_pair_logps(packed_model, p)
                idx = p.sample_ids
                losses, _ = dpo_loss(c, r, ref[idx, 0], ref[idx, 1], 0.1)
                return losses.sum() / denom

            t, rates = train(packed_model, split_steps(dpacks, d_steps), run, lambda p: len(p.triples))
            return t, rates, 1 - real_d / processed

        def padded_dpo(label_head: bool) -> Callable[[], tuple[float, list[float], float]]:
            def go() -> tuple[float, list[float], float]:
                order = list(range(len(pairs)))
                random.Random(args.seed).shuffle(order)
                batches = []
                for i in range(0, len(order), 8):
                    idx = order[i : i + 8]
                    b: dict[str, Any] = padded_pair_batch(pairs, idx, tok.pad_token_id)
                    b["idx"] = idx
                    b["real"] = sum(len(pairs[j]) for j in idx)
                    batches.append(b)
                processed = sum(int(b["input_ids"].numel()) for b in batches)

                def run(b: dict[str, Any], denom: int) -> torch.Tensor:
                    if label_head:
                        c, r = padded_pair_logps(padded_model, b)
                    else:
                        c, r = full_logits_pair_logps(padded_model, b)
                    losses, _ = dpo_loss(c, r, ref[b["idx"], 0], ref[b["idx"], 1], 0.1)
                    return losses.sum() / denom

                t, rates = train(padded_model, split_steps(batches, d_steps), run, lambda b: len(b["idx"]))
                return t, rates, 1 - real_d / processed

            return go

        dres = run_contenders(
            {
                f"packed-{args.pack}": packed_dpo,
                "padded-8-pairs": padded_dpo(False),
                "padded-8-pairs-label-head": padded_dpo(True),
            },
            skip,
            real_d,
            "padding+repeats",
        )
        print_table(
            "DPO", dres, "padded-8-pairs", "padding + repeated prompts", also="padded-8-pairs-label-head"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
