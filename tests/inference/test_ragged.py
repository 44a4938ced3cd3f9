"""The ragged plan's edge cases, on a tiny model's runner."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.inference.engine.plan import plan_for
from services.inference.engine.ragged import (
    KEY_BLOCK,
    MIN_QUERY_ROWS,
    DecodeRow,
    PrefillRow,
    attention_bias,
    invariant_attention,
    round_up,
)
from services.inference.engine.runner import ModelRunner


def test_a_short_chunk_after_a_long_one_attends_only_its_real_positions(tiny_model_path: Path) -> None:
    """A 256-token chunk next to a 6-token chunk starting at 300: the short chunk's padded
    queries reach position 555, past the slab's capacity (512, the context). Its logits must
    equal those of the same chunk run alone (this raised a size mismatch in SDPA before)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32).eval()
    long = PrefillRow(slot=0, token_ids=list(range(10, 266)), start=0)
    short = PrefillRow(slot=1, token_ids=[5, 6, 7, 8, 9, 11], start=300)
    together = ModelRunner(model, max_slots=2, max_len=512, plan=plan_for(model, forward="reference"))
    both = together.forward([], [long, short])
    assert together.cache.capacity == 512
    alone = ModelRunner(model, max_slots=2, max_len=1024, plan=plan_for(model, forward="reference")).forward(
        [], [short]
    )
    torch.testing.assert_close(both[1], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_attends_like_its_fp32_self(tiny_model_path: Path, dtype: torch.dtype) -> None:
    """A bf16 or fp16 model (the default dtype on GPUs) runs through the same attention: the
    mask's bias takes the model's dtype (an fp32 bias in a bf16 product raised before)."""
    from transformers import AutoModelForCausalLM

    prompt = PrefillRow(slot=0, token_ids=list(range(10, 40)), start=0)
    logits = {}
    for dt in (torch.float32, dtype):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=dt).eval()
        runner = ModelRunner(model, max_slots=2, max_len=128, plan=plan_for(model, forward="reference"))
        first = runner.forward([], [prompt])[0]
        step = runner.forward([DecodeRow(slot=0, token=int(first.argmax()), position=30)], [])[0]
        logits[dt] = torch.stack([first.float(), step.float()])
    torch.testing.assert_close(logits[dtype], logits[torch.float32], rtol=0.05, atol=0.05)


def _runner(model: torch.nn.Module, quantize: str) -> ModelRunner:
    return ModelRunner(model, max_slots=16, max_len=1024, plan=plan_for(model, quantize=quantize))  # type: ignore[arg-type]


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_a_row_is_computed_alike_whatever_shares_its_forward(lively_tiny_path: Path, quantize: str) -> None:
    """Batch invariance, bit for bit: a decode token's logits alone equal its logits among 15
    other rows at longer positions, and a prompt prefilled in one chunk gives the keys/values
    and the last logits it gives when split into chunks that share forwards with other prompts
    (the attended lengths and the products' row counts differ; the numbers must not)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(lively_tiny_path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 1000, (37,), generator=gen).tolist()
    others = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (90, 5, 150)]

    alone = _runner(model, quantize)
    whole = alone.forward([], [PrefillRow(slot=0, token_ids=prompt, start=0)])[0]
    lone_decode = alone.forward([DecodeRow(slot=0, token=7, position=len(prompt))], [])[0]

    shared = _runner(model, quantize)
    # the same prompt in three chunks (the last one token), each beside other prompts' chunks
    shared.forward([], [PrefillRow(slot=0, token_ids=prompt[:20], start=0), PrefillRow(1, others[0], 0)])
    shared.forward([], [PrefillRow(2, others[1], 0), PrefillRow(slot=0, token_ids=prompt[20:36], start=20)])
    split = shared.forward(
        [], [PrefillRow(3, others[2], 0), PrefillRow(slot=0, token_ids=prompt[36:], start=36)]
    )
    assert torch.equal(split[1], whole)
    for layer in range(alone.cache.num_layers):
        for a, b in ((alone.cache.k, shared.cache.k), (alone.cache.v, shared.cache.v)):
            assert torch.equal(a[layer][0, :, : len(prompt)], b[layer][0, :, : len(prompt)])
    # a full batch of decode rows, the others up to 200 positions further on
    rows = [DecodeRow(slot=0, token=7, position=len(prompt))]
    rows += [DecodeRow(slot=s, token=s, position=len(prompt) + 13 * s) for s in range(1, 16)]
    assert torch.equal(shared.forward(rows, [])[0], lone_decode)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


def test_invariant_attention_reduces_each_query_alike_in_any_batch(threads: int) -> None:
    """Each query's output, bit for bit, whatever shares the call: decode rows among others of
    any length (up to 1,500 keys, the attended length rounded up a few blocks further), and
    prompt queries in chunks of any width and start, split any way, beside other chunks. SDPA
    fails this (the attended length, the chunk width and, at 2 threads, the row count change a
    row's last bits); each operation ``invariant_attention`` uses was chosen by it."""
    rng = random.Random(threads)
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, slots = 9, 3, 64, 8
    keys, values = (torch.randn(slots, kv_heads, 2048, dim, generator=gen) for _ in range(2))
    queries = torch.randn(slots, heads, 2048, dim, generator=gen)  # (slot, position)'s query
    seen: dict[tuple[int, int], torch.Tensor] = {}
    compared = 0

    def check(slot: int, position: int, out: torch.Tensor) -> None:
        nonlocal compared
        key = (slot, position)
        if key in seen:
            compared += 1
            assert torch.equal(seen[key], out), f"slot {slot} position {position}"
        seen[key] = out

    for _ in range(30):  # decode: one query a row, slot r at its own position
        lengths = [rng.randint(1, 1500) if r else rng.choice([40, 700]) for r in range(rng.randint(1, slots))]
        width = min(2048, round_up(max(lengths)) + KEY_BLOCK * rng.randint(0, 2))
        n = len(lengths)
        mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).view(n, 1, 1, width)
        q = torch.stack([queries[r, :, lengths[r] - 1 : lengths[r]] for r in range(n)])
        out = invariant_attention(q, keys[:n, :, :width], values[:n, :, :width], attention_bias(mask), None)
        for r in range(n):
            check(r, lengths[r] - 1, out[r, :, 0])
    seen.clear()
    for _ in range(30):  # prompt chunks: (slot, start, length), padded to the widest
        chunks = [
            (s, rng.randrange(0, 800), rng.choice([1, 2, 3, 17, 64, 200]))
            for s in rng.sample(range(slots), 3)
        ]
        chunks[0] = (0, rng.choice([0, 10, 30]), rng.choice([30, 40]))  # slot 0 covers 30..39 each time
        width = max(MIN_QUERY_ROWS, *(n for *_, n in chunks))
        length = round_up(max(start + n for _, start, n in chunks))
        q = torch.stack([queries[s, :, start : start + width] for s, start, _ in chunks])
        positions = torch.tensor([start for _, start, _ in chunks]).unsqueeze(1) + torch.arange(width)
        mask = (torch.arange(length).view(1, 1, -1) <= positions.unsqueeze(2)).unsqueeze(1)
        index = torch.tensor([s for s, _, _ in chunks])
        out = invariant_attention(
            q, keys[index, :, :length], values[index, :, :length], attention_bias(mask), None
        )
        for c, (s, start, n) in enumerate(chunks):
            for i in range(n):
                check(s, start + i, out[c, :, i])
    assert compared > 300
