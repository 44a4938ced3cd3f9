"""The prefix cache: a prompt that starts from cached keys/values gives exactly the tokens
it gives when computed from scratch; it is keyed per adapter and dropped on weight updates."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from services.inference.engine import SamplingParams, TorchEngine
from services.inference.engine.kv_cache import SlabKVCache
from services.inference.engine.prefix_cache import PrefixCache
from tests.inference.test_engine import QUESTIONS, _chat, _load, _reference

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def lively(lively_tiny_path: Path) -> tuple[Any, Any]:
    return _load(lively_tiny_path)


def test_hit_gives_the_same_tokens_as_a_miss(lively: tuple[Any, Any]) -> None:
    model, tok = lively
    prompts = [_chat(tok, q) for q in QUESTIONS]
    refs = _reference(model, prompts, 24)
    cold = TorchEngine.from_model(model, tok, max_batch_size=4, prefix_cache_mb=0)
    assert [o.token_ids for o in cold.generate_batch(prompts, GREEDY)] == refs
    assert cold.scheduler.prefix_cache.hits == 0

    warm = TorchEngine.from_model(model, tok, max_batch_size=4)
    # one at a time: each later prompt starts from the system prompt cached by the first
    for prompt, ref in zip(prompts, refs, strict=True):
        assert warm.generate_batch([prompt], GREEDY)[0].token_ids == ref
    cache = warm.scheduler.prefix_cache
    assert cache.hits >= len(prompts) - 1
    # the same prompt again reuses all but its last token
    before = cache.hit_tokens
    assert warm.generate_batch([prompts[0]], GREEDY)[0].token_ids == refs[0]
    assert cache.hit_tokens - before == len(prompts[0]) - 1


def test_a_prompt_in_chunks_is_stored_once_whole(
    lively: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok = lively
    engine = TorchEngine.from_model(model, tok, max_batch_size=2, prefill_chunk=16)
    cache = engine.scheduler.prefix_cache
    stored: list[int] = []
    original = cache.store

    def counting(adapter: str, tokens: list[int], kv: Any, slot: int) -> None:
        stored.append(len(tokens))
        original(adapter, tokens, kv, slot)

    monkeypatch.setattr(cache, "store", counting)
    prompt = list(range(300, 370))  # five chunks of at most 16 tokens
    engine.generate_batch([prompt], GREEDY)
    # the chunks' prefixes are not copied on the way: the prompt is, once it is whole
    assert stored == [len(prompt)]
    assert [len(e.tokens) for e in cache.entries.values()] == [len(prompt)]
    before = cache.hit_tokens
    engine.generate_batch([[*prompt, 5, 6]], GREEDY)
    assert cache.hit_tokens - before == len(prompt)


def test_prompts_arriving_together_share_one_prefix_computation(lively: tuple[Any, Any]) -> None:
    model, tok = lively
    prompts = [_chat(tok, q) for q in QUESTIONS[:4]]
    refs = _reference(model, prompts, 24)
    engine = TorchEngine.from_model(model, tok, max_batch_size=4)
    outs = engine.generate_batch(prompts, GREEDY)
    assert [o.token_ids for o in outs] == refs
    # the oldest computed the shared prefix, the other three copied it
    assert engine.scheduler.prefix_cache.hits == 3


def test_seeded_sampling_is_reproducible_across_hits(lively: tuple[Any, Any]) -> None:
    model, tok = lively
    engine = TorchEngine.from_model(model, tok, max_batch_size=4)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=7, n=2)
    prompt = [_chat(tok, QUESTIONS[2])]
    first = [o.token_ids for o in engine.generate_batch(prompt, params)]
    second = [o.token_ids for o in engine.generate_batch(prompt, params)]
    assert engine.scheduler.prefix_cache.hits > 0
    assert first == second
    uncached = TorchEngine.from_model(model, tok, max_batch_size=4, prefix_cache_mb=0)
    assert [o.token_ids for o in uncached.generate_batch(prompt, params)] == first


def test_in_place_weight_update_drops_the_cache(lively: tuple[Any, Any]) -> None:
    """The trainer updates weights between rollouts; cached keys/values of the old weights
    must not be reused (here a change to the attention, so the keys/values differ)."""
    model, tok = lively
    model = copy.deepcopy(model)
    engine = TorchEngine.from_model(model, tok, max_batch_size=4)
    prompt = [_chat(tok, QUESTIONS[0])]
    before = engine.generate_batch(prompt, GREEDY)[0].token_ids
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(-1.5)
    after = engine.generate_batch(prompt, GREEDY)[0].token_ids
    assert after == _reference(model, prompt, 24)[0]
    assert after != before


def _slab(layers: int) -> SlabKVCache:
    """A small slab: 2 slots, one key/value head of 4 values, 64 positions."""
    return SlabKVCache(
        num_layers=layers,
        max_slots=2,
        kv_heads=1,
        head_dim=4,
        max_len=64,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_entries_are_keyed_per_adapter_and_bounded() -> None:
    slab = _slab(layers=2)
    slab.k[0][0, :, :10] = 1.0
    cache = PrefixCache(10_000)
    tokens = list(range(10))
    cache.store("a", tokens, slab, 0)
    assert cache.longest("b", [*tokens, 99])[0] is None
    entry, n = cache.longest("a", [*tokens[:6], 42, 43])
    assert entry is not None and n == 6
    # a full match still leaves the last token to compute
    assert cache.longest("a", tokens)[1] == 9
    cache.load_into(entry, n, slab, 1)
    assert torch.equal(slab.k[0][1, :, :6], slab.k[0][0, :, :6])
    # a longer prompt with the same start replaces its prefix entry; bytes stay bounded
    cache.store("a", [*tokens, 10, 11], slab, 0)
    assert len(cache.entries) == 1
    small = PrefixCache(2 * 2 * 4 * 4 * 12)  # room for one 12-token entry
    small.store("a", [*tokens, 10, 11], slab, 0)
    small.store("a", list(range(100, 112)), slab, 0)
    assert len(small.entries) == 1 and small.nbytes <= small.max_bytes
    assert small.longest("a", [*tokens, 5])[0] is None


def test_a_prefix_many_prompts_share_stays_while_unique_prompts_come_and_go() -> None:
    """Where two stored prompts branch off each other their common prefix (a system prompt) is
    kept as a shared entry, and every lookup refreshes the entries its prompt contains whole:
    a flood of unique prompts (another adapter's here) evicts the unique prompts, not it."""
    slab = _slab(layers=1)
    slab.k[0][0, :, :12] = torch.arange(12.0).view(1, 12, 1)
    entry_bytes = 2 * 4 * 4  # one token's keys and values
    cache = PrefixCache(entry_bytes * 40)  # about three whole 12-token prompts
    system = list(range(8))
    cache.store("a", [*system, 100, 101, 102, 103], slab, 0)
    cache.store("a", [*system, 200, 201, 202, 203], slab, 0)
    shared = [e for e in cache.entries.values() if e.shared]
    assert [e.tokens for e in shared] == [tuple(system)]
    assert torch.equal(shared[0].k[0], slab.k[0][0, :, :8])
    for i in range(20):
        entry, n = cache.longest("a", [*system, 300 + i, 1, 2])
        assert entry is not None and n == len(system), i
        cache.store("b", list(range(1000 + 20 * i, 1012 + 20 * i)), slab, 0)
        assert cache.nbytes <= cache.max_bytes
    # the unique prompts of "a" went, its system prompt did not
    assert [e.tokens for e in cache.entries.values() if e.adapter == "a"] == [tuple(system)]
    # a longer prompt that starts with the shared prefix leaves it in place
    cache.store("a", [*system, 7, 7, 7], slab, 0)
    assert (("a", tuple(system))) in cache.entries


def test_eviction_takes_whole_prompts_before_shared_prefixes_up_to_half_the_bytes() -> None:
    slab = _slab(layers=1)
    token_bytes = 2 * 4 * 4
    cache = PrefixCache(token_bytes * 40)
    cache.store("a", [*range(8), 100, 101, 102, 103], slab, 0)
    cache.store("a", [*range(8), 200, 201, 202, 203], slab, 0)  # a shared entry for range(8)
    # no lookups at all: unique prompts of another adapter push out "a"'s prompts, not its prefix
    for i in range(6):
        cache.store("b", list(range(1000 + 20 * i, 1012 + 20 * i)), slab, 0)
    assert [e.tokens for e in cache.entries.values() if e.adapter == "a"] == [tuple(range(8))]
    # shared prefixes beyond half the bytes go too, oldest first
    for i in range(6):
        cache.store("c", [500 + i, 1, 2, 3, 4, 5, 6, 7, 8, 9], slab, 0)
        cache.store("c", [500 + i, 1, 2, 3, 4, 5, 6, 7, 70, 71], slab, 0)
    shared = sum(e.nbytes for e in cache.entries.values() if e.shared)
    assert cache.nbytes <= cache.max_bytes and shared <= cache.max_bytes // 2 + 8 * token_bytes
    assert ("a", tuple(range(8))) not in cache.entries
