"""Training throughput: zero-padding packing against padded batches.

``python -m benchmarks.training [--sft-samples 192] [--dpo-pairs 96] [--layers 4] [--hidden 256]``

A SmolLM2-shaped model (Llama architecture, SmolLM2's tokenizer and 49K vocabulary,
tied embeddings) sized for 2 CPU cores, random weights, fp32. Every contender trains
on the same samples with the same number of optimizer steps (micro-batches are
accumulated into that many steps); the figure is *real* (non-padding) tokens per
second of forward + backward + AdamW step.

SFT (GSM8K train plus the chosen dialogues of HH-RLHF, mixed lengths):
  packed            BFD packs of <= 4096 tokens, FlashMask document mask (kernels)
  padded-16         batches of 16 padded to their longest (transformers DataCollatorWithPadding), SDPA,
                    the plain HF forward (logits at every position) and cross-entropy
  fixed-1024        every sample padded to 1024 tokens (the common fixed-length practice), same forward
The packed path also computes the output head only at label positions (see modeling.py); the
padded baselines run the standard HF forward, as a Trainer would. DPO: both contenders use
the label-position head, so the DPO ratio isolates packing with the shared prompt.
DPO (HH-RLHF):
  packed            prompt once + chosen + rejected per pair, shared-question mask, <= 4096 per pack
  padded-8          batches of 8 pairs = 16 rows (prompt+chosen, prompt+rejected) padded to the longest
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
from services.trainer.recipes.sft import pack_logps

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


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sft-samples", type=int, default=192)
    ap.add_argument("--dpo-pairs", type=int, default=96)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
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
        n_params = sum(p.numel() for p in packed_model.parameters())
        print(
            f"model: llama {args.layers} layers, hidden {args.hidden}, vocab {len(tok)}, {n_params / 1e6:.1f}M params, fp32, {args.threads} threads"
        )

        # ---------------- SFT
        samples = sft_samples(tok, args.sft_samples, args.seed)
        real = sum(len(s) for s in samples)
        n_steps = -(-len(samples) // 16)
        print(f"SFT: {len(samples)} samples, {real} real tokens, {n_steps} optimizer steps each")
        results: dict[str, tuple[float, float, float]] = {}

        def packed_sft() -> tuple[float, list[float], float]:
            plan = shuffled_bfd([len(s) for s in samples], args.pack, seed=args.seed)
            packs = [pack_sft(samples, idx, pad_id=tok.pad_token_id, pad_to_multiple_of=64) for idx in plan]
            processed = sum(p.total_tokens for p in packs)

            def run(p: Any, denom: int) -> torch.Tensor:
                logps, _ = pack_logps(packed_model, p)
                return -logps.sum() / denom

            t, rates = train(
                packed_model, split_steps(packs, n_steps), run, lambda p: int((p.labels != IGNORE).sum())
            )
            return t, rates, 1 - real / processed

        def padded_sft(fixed: int | None, bs: int) -> Callable[[], tuple[float, list[float], float]]:
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
            "fixed-1024": padded_sft(1024, 4),
        }
        for name, fn in contenders.items():
            if name in skip:
                continue
            t, rates, pad = fn()
            results[name] = (real / t, statistics.median(rates), pad)
            print(
                f"  {name:<14} {real / t:10.0f} tok/s  (median step {statistics.median(rates):8.0f})  padding {pad:6.1%}  {t:7.1f} s",
                flush=True,
            )
        base = results.get("padded-16")
        print("\n| SFT contender | real tokens/s | median step tok/s | padding | vs padded-16 |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name, (tps, med, pad) in results.items():
            ratio = f"{tps / base[0]:.2f}x" if base else "-"
            print(f"| {name} | {tps:.0f} | {med:.0f} | {pad:.1%} | {ratio} |")

        # ---------------- DPO
        pairs = dpo_pairs(tok, args.dpo_pairs, args.seed)
        real_d = sum(len(p) for p in pairs)
        d_steps = -(-len(pairs) // 8)
        print(
            f"\nDPO: {len(pairs)} pairs, {real_d} unique tokens (prompt once), {d_steps} optimizer steps each"
        )
        ref = torch.zeros(len(pairs), 2)
        dres: dict[str, tuple[float, float, float]] = {}

        def packed_dpo() -> tuple[float, list[float], float]:
            plan = shuffled_bfd([len(p) for p in pairs], args.pack, seed=args.seed)
            packs = [pack_pairs(pairs, idx, pad_id=tok.pad_token_id, pad_to_multiple_of=64) for idx in plan]
            processed = sum(p.total_tokens for p in packs)

            def run(p: Any, denom: int) -> torch.Tensor:
                c, r = pack_pair_logps(packed_model, p)
                idx = p.sample_ids
                losses, _ = dpo_loss(c, r, ref[idx, 0], ref[idx, 1], 0.1)
                return losses.sum() / denom

            t, rates = train(packed_model, split_steps(packs, d_steps), run, lambda p: len(p.triples))
            return t, rates, 1 - real_d / processed

        def padded_dpo() -> tuple[float, list[float], float]:
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
                c, r = padded_pair_logps(padded_model, b)
                losses, _ = dpo_loss(c, r, ref[b["idx"], 0], ref[b["idx"], 1], 0.1)
                return losses.sum() / denom

            t, rates = train(padded_model, split_steps(batches, d_steps), run, lambda b: len(b["idx"]))
            return t, rates, 1 - real_d / processed

        for name, fn in ((f"packed-{args.pack}", packed_dpo), ("padded-8-pairs", padded_dpo)):
            if name in skip:
                continue
            t, rates, pad = fn()
            dres[name] = (real_d / t, statistics.median(rates), pad)
            print(
                f"  {name:<14} {real_d / t:10.0f} tok/s  (median step {statistics.median(rates):8.0f})  padding+repeats {pad:6.1%}  {t:7.1f} s",
                flush=True,
            )
        dbase = dres.get("padded-8-pairs")
        print(
            "\n| DPO contender | real tokens/s | median step tok/s | padding + repeated prompts | vs padded-8-pairs |"
        )
        print("| --- | ---: | ---: | ---: | ---: |")
        for name, (tps, med, pad) in dres.items():
            ratio = f"{tps / dbase[0]:.2f}x" if dbase else "-"
            print(f"| {name} | {tps:.0f} | {med:.0f} | {pad:.1%} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
