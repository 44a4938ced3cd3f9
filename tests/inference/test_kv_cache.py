"""The slab KV cache's memory: the whole context mapped lazily on the CPU, grown by doubling otherwise."""

from __future__ import annotations

import mmap

import pytest
import torch

from services.inference.engine.kv_cache import SlabKVCache, mapped_zeros

CPU = torch.device("cpu")


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the memory map holding ``t`` that are in memory (its Rss in /proc/self/smaps)."""
    address = t.data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the tensor")


def _cache(**kw: object) -> SlabKVCache:
    args: dict[str, object] = dict(
        num_layers=2, max_slots=4, kv_heads=2, head_dim=8, max_len=1000, dtype=torch.float32, device=CPU
    )
    args.update(kw)
    return SlabKVCache(**args)  # type: ignore[arg-type]


def test_a_cpu_slab_spans_the_context_and_takes_memory_only_where_written() -> None:
    # 2 layers x (keys, values) x 16 slots x 8 heads x 2,048 positions x 128 x 4 bytes: 512 MiB
    cache = _cache(max_slots=16, kv_heads=8, head_dim=128, max_len=2048)
    assert cache.lazy and cache.capacity == 2048 and cache.nbytes() == 512 << 20
    assert _resident_bytes(cache.k[1]) == 0
    cache.k[1][5, :, :1500] = 1.5  # one slot's 1,500 positions of one layer's keys
    written = 8 * 1500 * 128 * 4  # 8 heads' runs of 1,500 x 128 floats: each starts and ends mid-page
    assert written <= _resident_bytes(cache.k[1]) <= written + 8 * 2 * mmap.PAGESIZE
    assert float(cache.k[1][5].sum()) == 1.5 * 8 * 1500 * 128
    assert float(cache.k[1][4].abs().sum()) == 0.0 and float(cache.v[0].abs().sum()) == 0.0
    # no growth: a request as long as the context writes where the slab already is
    slab = cache.k[0]
    cache.ensure_capacity(2048)
    assert cache.k[0] is slab


def test_mapped_zeros_are_writable_zeros_of_the_dtype() -> None:
    t = mapped_zeros((3, 5), torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.shape == (3, 5) and not t.any()
    t[1, 2] = 2.0
    assert float(t.sum()) == 2.0


def test_a_grown_slab_doubles_and_keeps_what_was_written() -> None:
    cache = _cache(lazy=False, initial_capacity=64)
    assert cache.capacity == 64
    cache.k[0][2, 1, :64] = torch.arange(64, dtype=torch.float32)[:, None]
    cache.ensure_capacity(200)
    assert cache.capacity == 256
    assert torch.equal(cache.k[0][2, 1, :64, 0], torch.arange(64, dtype=torch.float32))
    assert not cache.k[0][2, 1, 64:].any()
    with pytest.raises(ValueError, match="context is 1000"):
        cache.ensure_capacity(1001)


def test_a_lazy_cache_off_the_cpu_is_refused() -> None:
    with pytest.raises(ValueError, match="meta"):
        _cache(lazy=True, device=torch.device("meta"))


def test_a_map_the_system_refuses_falls_back_to_growing(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.inference.engine import kv_cache

    def refuse(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(kv_cache, "mapped_zeros", refuse)
    cache = _cache(initial_capacity=64)
    assert not cache.lazy and cache.capacity == 64 and not cache.k[1].any()
    cache.ensure_capacity(100)
    assert cache.capacity == 128
