"""Packing: BFD bounds, restarted positions, boundary labels, and packed == unpacked (fp32)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from services.trainer.data.formats import ChatRecord, PreferenceRecord, of_kind, parse_dataset
from services.trainer.data.packing import best_fit_decreasing, pack_pairs, pack_sft, shuffled_bfd
from services.trainer.data.tokenize import IGNORE, SFTSample, tokenize_pair, tokenize_sft
from services.trainer.losses import dpo_loss
from services.trainer.modeling import load_causal_lm
from services.trainer.recipes.dpo import pack_pair_logps, padded_pair_batch, padded_pair_logps
from services.trainer.recipes.sft import pack_logps, pad_batch, padded_logps


def test_bfd_respects_capacity_and_keeps_every_sample() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 500) for _ in range(3000)]
    packs = shuffled_bfd(lengths, 1024, seed=1, buffer_size=512)
    flat = sorted(i for p in packs for i in p)
    assert flat == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p) <= 1024 for p in packs)
    fill = sum(lengths) / (len(packs) * 1024)
    assert fill > 0.97, fill
    # the order stays mixed: the first packs do not hold only the longest samples
    first = [lengths[i] for p in packs[:10] for i in p]
    assert min(first) < 100


def test_bfd_refuses_a_sample_longer_than_the_pack() -> None:
    with pytest.raises(ValueError, match="more than max_tokens_per_pack=10"):
        best_fit_decreasing([3, 11], 10)


def test_pack_layout_positions_labels_and_mask() -> None:
    samples = [SFTSample([1, 2, 3], [IGNORE, 2, 3]), SFTSample([4, 5], [IGNORE, 5])]
    pack = pack_sft(samples, [0, 1], pad_id=0, pad_to_multiple_of=8)
    assert pack.input_ids.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
    assert pack.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    # shifted: label at t is token t+1 of the same sample; -100 at each sample's end and on padding
    assert pack.labels.tolist() == [[2, 3, IGNORE, 5, IGNORE, IGNORE, IGNORE, IGNORE]]
    assert pack.real_tokens == 5 and pack.total_tokens == 8
    mask = pack.mask()
    assert mask.shape == (1, 1, 8, 1) and mask.dtype == torch.int32
    assert mask[0, 0, :, 0].tolist() == [3, 3, 3, 5, 5, 8, 8, 8]


def test_chat_template_labels_only_assistant_tokens(tiny_model_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    msgs = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6."},
    ]
    s = tokenize_sft(tok, msgs)
    assert s.input_ids == tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    learned = tok.decode([t for t, lab in zip(s.input_ids, s.labels, strict=True) if lab != IGNORE])
    assert learned == "It is 4.<|im_end|>\n6.<|im_end|>\n"


@pytest.fixture(scope="module")
def fp32_models(tiny_model_path: Path) -> tuple:
    torch.manual_seed(0)
    return load_causal_lm(tiny_model_path), load_causal_lm(tiny_model_path, attn="sdpa")


@pytest.fixture(params=["head-kept", "head-chunked"])
def head_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways the label-position head runs: logits kept for the backward (packs up to
    HEAD_SAVE_ELEMENTS logits) and chunked with recompute (the long-context path)."""
    import services.trainer.modeling as modeling

    if request.param == "head-chunked":
        monkeypatch.setattr(modeling, "HEAD_SAVE_ELEMENTS", 0)
    return str(request.param)


def test_packed_sft_loss_and_grads_equal_unpacked(
    tiny_model_path: Path, gsm8k_rows: bytes, fp32_models: tuple, head_path: str
) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    samples = [
        tokenize_sft(tok, r.messages) for r in of_kind(parse_dataset(gsm8k_rows).records[:12], ChatRecord)
    ]
    packed_model, plain_model = fp32_models
    plan = shuffled_bfd([len(s) for s in samples], 1024, seed=0)
    assert len(plan) < len(samples)  # several samples per pack
    packs = [pack_sft(samples, idx, pad_id=tok.pad_token_id, pad_to_multiple_of=64) for idx in plan]
    n_tokens = sum(int((p.labels != IGNORE).sum()) for p in packs)

    packed_model.zero_grad()
    packed_loss = 0.0
    for p in packs:
        logps, _ = pack_logps(packed_model, p)
        loss = -logps.sum() / n_tokens
        loss.backward()
        packed_loss += float(loss.detach())
    plain_model.zero_grad()
    plain_loss = 0.0
    for i in range(len(samples)):  # one sample at a time: no packing, no padding
        logps, _ = padded_logps(plain_model, pad_batch(samples, [i], tok.pad_token_id))
        loss = -logps.sum() / n_tokens
        loss.backward()
        plain_loss += float(loss.detach())

    assert abs(packed_loss - plain_loss) <= 1e-5
    plain_grads = dict(plain_model.named_parameters())
    worst = max(float((p.grad - plain_grads[n].grad).abs().max()) for n, p in packed_model.named_parameters())
    assert worst <= 1e-5, worst


def test_packed_dpo_loss_equals_unpacked(tiny_model_path: Path, hh_rows: bytes, fp32_models: tuple) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    recs = of_kind(parse_dataset(hh_rows).records[:8], PreferenceRecord)
    pairs = [tokenize_pair(tok, r.prompt, r.chosen, r.rejected) for r in recs]
    packed_model, plain_model = fp32_models
    plan = shuffled_bfd([len(p) for p in pairs], 2048, seed=0)
    assert any(len(p) > 1 for p in plan)  # several pairs per pack
    chosen = torch.zeros(len(pairs))
    rejected = torch.zeros(len(pairs))
    with torch.no_grad():
        for idx in plan:
            c, r = pack_pair_logps(
                packed_model, pack_pairs(pairs, idx, pad_id=tok.pad_token_id, pad_to_multiple_of=64)
            )
            chosen[idx], rejected[idx] = c, r
        c2, r2 = padded_pair_logps(
            plain_model, padded_pair_batch(pairs, list(range(len(pairs))), tok.pad_token_id)
        )
    # reference log-probs: a fixed shift, as if from another model
    ref_c, ref_r = c2 - 0.5, r2 + 0.25
    packed, _ = dpo_loss(chosen, rejected, ref_c, ref_r, beta=0.1)
    unpacked, _ = dpo_loss(c2, r2, ref_c, ref_r, beta=0.1)
    assert abs(float(packed.mean()) - float(unpacked.mean())) <= 1e-5
    assert torch.allclose(chosen, c2, rtol=1e-6, atol=1e-3)
