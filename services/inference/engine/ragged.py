"""One forward for a mixed batch: decode tokens and prompt chunks of many sequences, flattened.

Every token is its own batch row (input ids ``[T, 1]``), so the linear layers -- most of
the work -- see exactly the real tokens with no padding, PEFT routes each row to its own
adapter, and RoPE takes each token's own position. Only attention must know which tokens
belong together; the plan built here says so, and ``ragged_attention`` (registered with
transformers as the attention implementation ``tandem_ragged``) does two batched SDPA
calls per layer over the slab KV cache, whose ``update`` has just written every token's
key and value at its (slot, position):

- decode tokens: one query per slab row, attending that row's keys up to its position
  (the slab rows are a view, not a copy);
- prompt chunks: their queries gathered into a padded ``[P, S]`` block, each chunk
  attending its slot's keys causally from the chunk's start (a prefix already in the
  cache included); padded queries are computed and dropped (attention is a small part
  of the work at these lengths).

Mixing both in one forward is what makes continuous batching cheap on a CPU: a forward
re-reads every weight (~55 ms for SmolLM2-135M in fp32 on 2 cores), so a separate
prefill forward for each arrival would stall every running stream by that much.

**Batch invariance.** A token's numbers must not depend on what else shares its forward
(greedy output alone = in a batch, bit for bit). SDPA on a CPU does depend on it: the
attended length is the longest row's (decode) or the longest chunk's end (prompts), its
reductions group their terms by that length, its query blocks by the chunk's width, and with
2 threads it differs by the number of rows as well; so a row's last bits changed with the others
(SmolLM2 with int4 decode, whose bf16 activations amplify such bits into another token:
3 of 16 prompts' greedy tokens, and every prompt's logprobs, differed alone vs in a batch of
16). ``invariant_attention`` is attention written so that each query is reduced the same way
whatever shares its forward, from operations measured to behave so (every one of them checked
by ``tests/inference/test_ragged.py``, bit for bit, at 1 and 2 threads):

- the attended length is a whole number of ``KEY_BLOCK`` keys, so softmax's vectorised sum
  has no ragged tail, and keys masked past a query add exact zeros at the end of it;
- the scores are one product over the head dimension (its length is fixed), scaled and
  masked inside it (``baddbmm`` with an additive bias);
- the product with the values runs block by block (a BLAS product over all keys splits its
  sum by the length), each block added to the sum of the blocks before it (``baddbmm``), so
  a block past the query adds zero; blocks are views of the slab, nothing is copied;
- the products have a row count that is the same for every decode step (the query heads
  of one key/value head) or at least ``MIN_QUERY_ROWS`` (prompt chunks): MKL computes a row
  of a product of 1-3 rows another way than of 4 or more, which all agree row for row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from services.inference.engine.kv_cache import CAPACITY_BLOCK, round_up

ATTENTION_NAME = "tandem_ragged"
# keys are reduced in blocks of this many positions (the attended lengths are rounded up to
# it; the slab's capacity is a multiple of it)
KEY_BLOCK = CAPACITY_BLOCK
# a prompt chunk's padded query block has at least this many rows: CPU BLAS (MKL) computes a
# product of 1-3 rows another way than one of 4 or more, which all agree row for row
MIN_QUERY_ROWS = 4


def adapter_key(adapter: str | None) -> str:
    """A row's LoRA adapter as PEFT's mixed batch names it ("__base__": the base model alone)."""
    return adapter or "__base__"


@dataclass
class DecodeRow:
    """Extend sequence ``slot`` by ``token`` at ``position``."""

    slot: int
    token: int
    position: int
    adapter: str | None = None


@dataclass
class PrefillRow:
    """Prompt tokens ``token_ids`` of sequence ``slot``, the first at position ``start``."""

    slot: int
    token_ids: list[int]
    start: int
    adapter: str | None = None


@dataclass
class RaggedPlan:
    input_ids: torch.Tensor  # [T, 1]
    positions: torch.Tensor  # [T, 1]
    write_slots: torch.Tensor  # [T] slab row each token's key/value goes to
    write_positions: torch.Tensor  # [T]
    logit_rows: torch.Tensor  # [D + P] decode tokens, then each chunk's last token
    adapters: list[str]  # per token, for PEFT's mixed-batch LoRA
    max_position: int
    # decode tokens (the first D tokens): attention over slab rows [0, decode_view)
    n_decode: int = 0
    decode_view: int = 0
    decode_rows: torch.Tensor | None = None  # slab row of each decode token; None: rows 0..D-1
    decode_len: int = 0
    decode_bias: torch.Tensor | None = None  # [decode_view, 1, 1, decode_len] (attention_bias)
    # several decode tokens share a slot: each token is its own attention row (decode_view = D),
    # its slot's keys gathered (decode_rows: each token's slot), decode_bias by token
    decode_gathered: bool = False
    # prompt chunks (the other tokens, chunk after chunk)
    prefill_slots: torch.Tensor | None = None  # [P]
    width: int = 0  # S, the longest chunk
    gather: torch.Tensor | None = None  # [P * S] prompt token index (from the first) of each padded query
    valid: torch.Tensor | None = None  # [sum L] index into P * S of the real queries
    prefill_len: int = 0
    prefill_bias: torch.Tensor | None = None  # [P, 1, S, prefill_len] (attention_bias)
    # the biases expanded to every key/value head's rows (``expand_bias``), made at the first
    # layer and shared by the others
    expanded: dict[str, torch.Tensor] = field(default_factory=dict)
    # this plan as layers with a sliding window attend it (``windowed``), by window, made at the
    # first such layer and shared by the others
    windows: dict[int, RaggedPlan] = field(default_factory=dict)


_ACTIVE_PLAN: ContextVar[RaggedPlan | None] = ContextVar("tandem_ragged_plan", default=None)


def build_plan(decode: list[DecodeRow], prefill: list[PrefillRow], device: torch.device) -> RaggedPlan:
    if not decode and not prefill:
        raise ValueError("a forward needs at least one decode token or prompt chunk")
    if any(not r.token_ids for r in prefill):
        raise ValueError("a prompt chunk must not be empty")
    decode_slots = [r.slot for r in decode]
    slots = sorted(set(decode_slots)) + [r.slot for r in prefill]
    if len(set(slots)) != len(slots):
        raise ValueError(f"a slot appears twice in one forward: {slots}")
    # several decode tokens of one slot (a draft verified, prompt_lookup.py): consecutive positions,
    # in order, so each attends the keys of those before it, written in the same layer
    shared = len(set(decode_slots)) != len(decode_slots)
    if shared:
        last: dict[int, int] = {}
        for row in decode:
            if row.slot in last and row.position != last[row.slot] + 1:
                raise ValueError(
                    f"decode tokens of slot {row.slot} must follow each other: position {row.position} "
                    f"after {last[row.slot]}"
                )
            last[row.slot] = row.position
    n_dec = len(decode)
    ids = [r.token for r in decode]
    pos = [r.position for r in decode]
    write_slots = [r.slot for r in decode]
    adapters = [adapter_key(r.adapter) for r in decode]
    logit_rows = list(range(n_dec))
    offsets = []
    for chunk in prefill:
        offsets.append(len(ids))
        n = len(chunk.token_ids)
        ids += chunk.token_ids
        pos += range(chunk.start, chunk.start + n)
        write_slots += [chunk.slot] * n
        adapters += [adapter_key(chunk.adapter)] * n
        logit_rows.append(len(ids) - 1)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    plan = RaggedPlan(
        input_ids=tensor(ids).unsqueeze(1),
        positions=tensor(pos).unsqueeze(1),
        write_slots=tensor(write_slots),
        write_positions=tensor(pos),
        logit_rows=tensor(logit_rows),
        adapters=adapters,
        max_position=max(pos),
    )
    if decode and shared:
        # one attention row a token, its slot's keys gathered (``decode_attention``)
        plan.n_decode = n_dec
        plan.decode_view = n_dec
        plan.decode_rows = tensor(decode_slots)
        plan.decode_gathered = True
        plan.decode_len = round_up(max(pos[:n_dec]) + 1)
        keys = torch.arange(plan.decode_len, device=device)
        plan.decode_bias = attention_bias(
            (keys.unsqueeze(0) <= tensor(pos[:n_dec]).unsqueeze(1)).view(n_dec, 1, 1, -1)
        )
    elif decode:
        rows = [r.slot for r in decode]
        view = max(rows) + 1
        row_pos = [0] * view  # rows that are not decoding see key 0 only (finite, dropped)
        for row in decode:
            row_pos[row.slot] = row.position
        plan.n_decode = n_dec
        plan.decode_view = view
        plan.decode_rows = None if rows == list(range(n_dec)) else tensor(rows)
        plan.decode_len = round_up(max(row_pos) + 1)
        keys = torch.arange(plan.decode_len, device=device)
        plan.decode_bias = attention_bias(
            (keys.unsqueeze(0) <= tensor(row_pos).unsqueeze(1)).view(view, 1, 1, -1)
        )
    if prefill:
        width = max(MIN_QUERY_ROWS, *(len(r.token_ids) for r in prefill))
        gather: list[int] = []
        valid: list[int] = []
        for p, (chunk, off) in enumerate(zip(prefill, offsets, strict=True)):
            n = len(chunk.token_ids)
            gather += [off - n_dec + min(s, n - 1) for s in range(width)]
            valid += range(p * width, p * width + n)
        starts = tensor([r.start for r in prefill])
        query_pos = starts.unsqueeze(1) + torch.arange(width, device=device).unsqueeze(0)  # [P, S]
        # Keys up to the longest chunk's real end: a shorter chunk's padded queries (s >= n, dropped
        # by ``valid``) would otherwise reach past it, and past the slab's capacity.
        plan.prefill_len = round_up(max(r.start + len(r.token_ids) for r in prefill))
        keys = torch.arange(plan.prefill_len, device=device)
        plan.prefill_slots = tensor([r.slot for r in prefill])
        plan.width = width
        plan.gather = tensor(gather)
        plan.valid = tensor(valid)
        plan.prefill_bias = attention_bias((keys.view(1, 1, -1) <= query_pos.unsqueeze(2)).unsqueeze(1))
    return plan


def windowed(plan: RaggedPlan, window: int) -> RaggedPlan:
    """``plan`` for a layer with a sliding attention window: each query attends only the keys at
    positions > its own - ``window`` (transformers' sliding-window mask), the others masked as
    past its position are (exact zeros in the same reductions: the batch invariance holds).
    ``plan`` itself where no query reaches past the window."""
    if plan.max_position < window:
        return plan
    found = plan.windows.get(window)
    if found is not None:
        return found
    positions = plan.positions.view(-1)
    decode_bias, prefill_bias = plan.decode_bias, plan.prefill_bias
    if decode_bias is not None:
        query = positions[: plan.n_decode]
        if not plan.decode_gathered:
            # one row of the slab's view a slot: rows that are not decoding see key 0 only
            rows = plan.decode_rows
            if rows is None:
                rows = torch.arange(plan.n_decode, device=query.device)
            query = query.new_zeros(plan.decode_view).index_copy_(0, rows, query)
        keys = torch.arange(plan.decode_len, device=query.device)
        far = keys.unsqueeze(0) <= (query - window).unsqueeze(1)
        decode_bias = decode_bias.masked_fill(far.view(decode_bias.shape), float("-inf"))
    if prefill_bias is not None:
        assert plan.gather is not None
        # a padded query takes its chunk's last token's position: it attends that token's keys
        query = positions[plan.n_decode :].index_select(0, plan.gather).view(-1, plan.width)
        keys = torch.arange(plan.prefill_len, device=query.device)
        far = keys.view(1, 1, -1) <= (query - window).unsqueeze(2)
        prefill_bias = prefill_bias.masked_fill(far.unsqueeze(1), float("-inf"))
    found = dataclasses.replace(
        plan, decode_bias=decode_bias, prefill_bias=prefill_bias, expanded={}, windows={}
    )
    plan.windows[window] = found
    return found


def ragged_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    tandem_decode_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """``query`` ``[T, H, 1, d]``; ``key``/``value``: the layer's whole slab ``[slots, Hkv, cap, d]``.

    Returns ``[T, 1, H, d]`` (the layout transformers' attention functions return).
    ``tandem_decode_mask`` (``[T, 1, 1, L]``, handed down the forward's keyword arguments):
    a pure decode step, token ``t`` in slab row ``t`` (the compiled step: no context variable
    for dynamo to trace), through SDPA: the compiled step is not batch-invariant (see the module doc).
    ``sliding_window``: the layer's window, as the model's attention module hands it (``windowed``)."""
    if tandem_decode_mask is not None:
        rows, length = tandem_decode_mask.shape[0], tandem_decode_mask.shape[-1]
        k, v = key[:rows, :, :length].to(query.dtype), value[:rows, :, :length].to(query.dtype)
        out = F.scaled_dot_product_attention(
            query, k, v, attn_mask=tandem_decode_mask, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2), None
    plan = _ACTIVE_PLAN.get()
    if plan is None:
        raise RuntimeError("tandem_ragged attention runs only inside a ModelRunner forward")
    if sliding_window is not None:
        plan = windowed(plan, sliding_window)
    q = query[:, :, 0]  # [T, H, d]
    parts = []
    if plan.n_decode:
        parts.append(decode_attention(plan, q[: plan.n_decode], key, value, scaling))
    if plan.prefill_slots is not None:
        parts.append(prefill_attention(plan, q[plan.n_decode :], key, value, scaling))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.unsqueeze(1), None


def prefill_attention(
    plan: RaggedPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """The attention of a plan's prompt tokens: ``query`` ``[sum L, H, d]`` (the chunks' tokens,
    chunk after chunk), ``key``/``value`` the layer's whole slab. Returns ``[sum L, H, d]``."""
    assert plan.prefill_slots is not None and plan.gather is not None and plan.valid is not None
    assert plan.prefill_bias is not None
    heads, dim = query.shape[1], query.shape[2]
    chunks = len(plan.prefill_slots)
    qp = query.index_select(0, plan.gather).view(chunks, plan.width, heads, dim).transpose(1, 2)
    # slice before gathering: only the attended positions are copied, not the capacity
    k = key[:, :, : plan.prefill_len].index_select(0, plan.prefill_slots)
    v = value[:, :, : plan.prefill_len].index_select(0, plan.prefill_slots)
    out = _attend(plan, "prefill", plan.prefill_bias, qp, k, v, scaling)  # [P, H, S, d]
    return out.transpose(1, 2).reshape(chunks * plan.width, heads, dim).index_select(0, plan.valid)


def decode_attention(
    plan: RaggedPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """The attention of a plan's decode tokens: ``query`` ``[D, H, d]`` (token ``t`` of slab row
    ``plan.decode_rows[t]``, or ``t``), ``key``/``value`` the layer's whole slab. Returns ``[D, H, d]``."""
    assert plan.decode_bias is not None
    if plan.decode_gathered:
        assert plan.decode_rows is not None
        # a copy of each token's slot keys: a row's reduction is the same as over the slab's view
        # (the product's row count and attended length do not depend on the batch)
        k = key[:, :, : plan.decode_len].index_select(0, plan.decode_rows)
        v = value[:, :, : plan.decode_len].index_select(0, plan.decode_rows)
        return _attend(plan, "decode", plan.decode_bias, query.unsqueeze(2), k, v, scaling)[:, :, 0]
    if plan.decode_rows is not None:
        query = query.new_zeros(plan.decode_view, *query.shape[1:]).index_copy_(0, plan.decode_rows, query)
    k = key[: plan.decode_view, :, : plan.decode_len]
    v = value[: plan.decode_view, :, : plan.decode_len]
    out = _attend(plan, "decode", plan.decode_bias, query.unsqueeze(2), k, v, scaling)[:, :, 0]
    return out if plan.decode_rows is None else out.index_select(0, plan.decode_rows)


def attention_bias(mask: torch.Tensor) -> torch.Tensor:
    """A boolean attention mask (True: attend) as the additive bias ``invariant_attention``
    takes: 0 where a query attends a key, -inf where it does not."""
    return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))


def expand_bias(bias: torch.Tensor, kv_heads: int, group: int) -> torch.Tensor:
    """``bias`` ``[B, 1, S, L]`` as ``invariant_attention``'s product adds it: one row per
    (sequence, key/value head) pair and query head of the group, ``[B * Hkv, group * S, L]``."""
    batch, _, width, length = bias.shape
    expanded = bias.view(batch, 1, 1, width, length).expand(batch, kv_heads, group, width, length)
    return expanded.reshape(batch * kv_heads, group * width, length)


def invariant_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Attention whose result for a query depends only on that query and the keys it attends
    (see the module doc). ``query`` ``[B, H, S, d]``; ``key``/``value`` ``[B, Hkv, L, d]``
    (views of the slab are fine) with ``L`` a multiple of ``KEY_BLOCK``; ``bias``
    ``[B, 1, S, L]`` (``attention_bias``: every query attends key 0 at least), or that
    through ``expand_bias`` already. Returns ``[B, H, S, d]``."""
    batch, heads, width, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads  # query heads sharing a key/value head (GQA): one product's rows
    pairs, rows = batch * kv_heads, group * width
    # scores, scaled and masked, in one product: bias + scale * q.k (-inf where masked)
    scores = torch.baddbmm(
        bias if bias.dim() == 3 else expand_bias(bias, kv_heads, group),
        query.reshape(pairs, rows, dim),
        key.reshape(pairs, length, dim).transpose(1, 2),
        alpha=dim**-0.5 if scale is None else scale,
    )
    # softmax sums a whole number of vector widths: masked keys past the query add exact zeros
    weights = torch.softmax(scores, -1)
    # the product with the values block by block, over KEY_BLOCK keys each (a BLAS product
    # over all keys splits that sum by its length), each block added to the sum of those
    # before it (a block past the query adds zero); views of the slab, no copies
    values = value.reshape(pairs, length, dim)
    out = torch.bmm(weights[:, :, :KEY_BLOCK], values[:, :KEY_BLOCK])
    for start in range(KEY_BLOCK, length, KEY_BLOCK):
        block = slice(start, start + KEY_BLOCK)
        out.baddbmm_(weights[:, :, block], values[:, block])
    return out.view(batch, heads, width, dim)


def prefill_bias_for(plan: RaggedPlan, dtype: torch.dtype, kv_heads: int, group: int) -> torch.Tensor:
    """The prompt chunks' bias as the CPU's ``invariant_attention`` takes it (made once a forward)."""
    assert plan.prefill_bias is not None
    return _expanded(plan, "prefill", plan.prefill_bias, dtype, kv_heads, group)


def _expanded(
    plan: RaggedPlan, kind: str, bias: torch.Tensor, dtype: torch.dtype, kv_heads: int, group: int | None
) -> torch.Tensor:
    # the bias in the query's dtype (a bf16 or fp16 model's products take no fp32 operand), on
    # the CPU expanded to every key/value head's rows (group None: as is, for SDPA); made at the
    # first layer and reused by the others
    if kind not in plan.expanded:
        cast = bias.to(dtype)
        plan.expanded[kind] = cast if group is None else expand_bias(cast, kv_heads, group)
    return plan.expanded[kind]


def _attend(
    plan: RaggedPlan,
    kind: str,
    bias: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """One branch's attention. On the CPU the batch-invariant product; on an accelerator SDPA's
    fused kernels (the block loop would cost a kernel launch per 64 keys per layer), where greedy
    output may depend on the batch."""
    cpu = query.device.type == "cpu"
    if key.dtype != query.dtype:
        # a 16-bit KV cache under an fp32 model (plan.kv_dtype): widened exactly to the queries' dtype
        key, value = key.to(query.dtype), value.to(query.dtype)
    group = query.shape[1] // key.shape[1] if cpu else None
    expanded = _expanded(plan, kind, bias, query.dtype, key.shape[1], group)
    if cpu:
        return invariant_attention(query, key, value, expanded, scale)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=expanded, scale=scale, enable_gqa=True)


def decode_token_count() -> int | None:
    """How many of this forward's first tokens are decode tokens (None outside a forward):
    a layer may compute them differently from prompt tokens, the same way in every batch."""
    plan = _ACTIVE_PLAN.get()
    return None if plan is None else plan.n_decode


def register() -> str:
    """Make ``tandem_ragged`` known to transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ragged_attention)
    return ATTENTION_NAME


@contextmanager
def active(plan: RaggedPlan) -> Iterator[RaggedPlan]:
    """``plan`` is the one the attention layers read during this forward (this thread only)."""
    token = _ACTIVE_PLAN.set(plan)
    try:
        yield plan
    finally:
        _ACTIVE_PLAN.reset(token)
