"""The ragged plan's edge cases, on a tiny model's runner."""

from __future__ import annotations

from pathlib import Path

import torch

from services.inference.engine.ragged import PrefillRow
from services.inference.engine.runner import ModelRunner


def test_a_short_chunk_after_a_long_one_attends_only_its_real_positions(tiny_model_path: Path) -> None:
    """A 256-token chunk next to a 6-token chunk starting at 300: the short chunk's padded
    queries reach position 555, past the slab's capacity (512). Its logits must equal those of
    the same chunk run alone (this raised a size mismatch in SDPA before)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32).eval()
    long = PrefillRow(slot=0, token_ids=list(range(10, 266)), start=0)
    short = PrefillRow(slot=1, token_ids=[5, 6, 7, 8, 9, 11], start=300)
    together = ModelRunner(model, max_slots=2, max_len=1024, packed_weights=False)
    both = together.forward([], [long, short])
    assert together.cache.capacity == 512
    alone = ModelRunner(model, max_slots=2, max_len=1024, packed_weights=False).forward([], [short])
    torch.testing.assert_close(both[1], alone[0], rtol=1e-5, atol=1e-5)
