"""Batched sampling over the logits of every row that produced a token in a step.

Greedy rows take the argmax. Sampled rows are filtered (temperature, top-k, top-p) in
one batched pass, then each row draws with its own ``torch.Generator`` so a seeded
request gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from services.inference.engine.types import SamplingParams


@dataclass
class RowSampling:
    params: SamplingParams
    generator: torch.Generator | None
    # the sequence's tokens so far, read by the penalties (only when the request has any)
    prompt_ids: list[int] | None = None
    output_ids: list[int] | None = None
    # an xgrammar GrammarMatcher when the request is constrained
    matcher: Any = None


def _process(logits: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Apply each row's own logit processors; rows without any are left untouched.

    Order as in vLLM: penalties (repetition over prompt and output, frequency and presence
    over the output), then logit_bias, then the grammar's mask (last, so nothing can
    re-allow a token the grammar forbids).
    """
    touched = [i for i, r in enumerate(rows) if r.params.processed or r.matcher is not None]
    if not touched:
        return logits
    out = logits.clone()
    vocab = out.shape[-1]
    masks: list[tuple[int, Any]] = []
    for i in touched:
        p, row = rows[i].params, out[i]
        if p.penalized:
            output = torch.tensor(rows[i].output_ids or [], dtype=torch.long, device=out.device)
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(
                    sorted(set(rows[i].prompt_ids or []) | set(rows[i].output_ids or [])),
                    dtype=torch.long,
                    device=out.device,
                )
                if seen.numel():
                    vals = row[seen]
                    row[seen] = torch.where(
                        vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                    )
            if output.numel() and (p.frequency_penalty or p.presence_penalty):
                counts = torch.bincount(output, minlength=vocab)[:vocab].to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=out.device)
            row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=out.device)
        if rows[i].matcher is not None:
            masks.append((i, rows[i].matcher))
    if masks:
        from services.inference.engine.guided import apply_masks

        apply_masks(out, masks)
    return out


def _filter(
    logits: torch.Tensor,
    temps: torch.Tensor,
    top_k: list[int],
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    scaled = logits / temps.unsqueeze(1)
    if min_p is not None:
        # min-p: drop tokens whose probability is below min_p times the most likely one's
        probs = torch.softmax(scaled, dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    vocab = scaled.shape[-1]
    ks = [k if 0 < k < vocab else 0 for k in top_k]
    if any(ks):
        kmax = max(ks)
        kth = torch.topk(scaled, kmax, dim=-1).values
        idx = torch.tensor([(k if k else kmax) - 1 for k in ks], device=scaled.device)
        thresh = kth.gather(1, idx.unsqueeze(1))
        use = torch.tensor([bool(k) for k in ks], device=scaled.device).unsqueeze(1)
        scaled = torch.where(use & (scaled < thresh), torch.full_like(scaled, float("-inf")), scaled)
    if bool((top_p < 1.0).any()):
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
    return scaled


def sample(logits: torch.Tensor, rows: list[RowSampling]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row and its log-probability under the raw model distribution.

    ``logits`` is ``[R, V]``; returns ``(tokens[R], raw_logprobs[R, V])`` on the CPU. The
    log-probabilities are of the model's raw distribution (before penalties, bias and the
    grammar's mask), like vLLM's default.
    """
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    logits = _process(logits, rows)
    tokens = torch.argmax(logits, dim=-1)
    sampled = [i for i, r in enumerate(rows) if r.params.temperature > 0]
    if sampled:
        sub = logits[sampled]
        temps = torch.tensor([rows[i].params.temperature for i in sampled], device=sub.device)
        top_p = torch.tensor([rows[i].params.top_p for i in sampled], device=sub.device)
        min_ps = [rows[i].params.min_p for i in sampled]
        min_p = torch.tensor(min_ps, device=sub.device) if any(min_ps) else None
        filtered = _filter(sub, temps, [rows[i].params.top_k for i in sampled], top_p, min_p)
        probs = torch.softmax(filtered, dim=-1)
        # Exponential-race sampling (argmax of p / E, E ~ Exp(1)) equals a categorical draw
        # and lets each row use its own generator without a Python loop over the vocabulary.
        noise = torch.empty_like(probs)
        for j, i in enumerate(sampled):
            noise[j].exponential_(generator=rows[i].generator)
        picked = torch.argmax(probs / noise, dim=-1)
        tokens[sampled] = picked
    return tokens.cpu(), raw_logprobs


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return gen
