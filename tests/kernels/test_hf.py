"""attn_implementation="flashmask": packed samples give each sample's solo logits (fp32, <= 1e-5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tandem_kernels
import torch
from tandem_kernels.flashmask import hf as fm_hf
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from tests.helpers.models import small_decoder

LENS = [7, 1, 12, 5]  # includes a one-token sample


def _config(kind: str) -> LlamaConfig | Qwen2Config:
    common = small_decoder(97, max_positions=128)
    if kind == "llama":
        return LlamaConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=True)
    return Qwen2Config(**common, rms_norm_eps=1e-6, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def saved_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(request.param))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path


def _load(path: Path, attn: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32)
    return model.eval()


def test_register_returns_name() -> None:
    from transformers import AttentionInterface

    name = tandem_kernels.register_hf_attention()
    assert name == "flashmask"
    assert AttentionInterface._global_mapping[name] is fm_hf.flashmask_attention_forward


def test_packed_logits_equal_solo_logits(saved_model: Path) -> None:
    name = tandem_kernels.register_hf_attention()
    packed_model = _load(saved_model, name)
    solo_model = _load(saved_model, "eager")
    assert packed_model.config._attn_implementation == "flashmask"
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (1, sum(LENS)))
    with torch.no_grad():
        packed = packed_model(
            input_ids=ids,
            position_ids=tandem_kernels.lengths_to_position_ids(LENS),
            startend_row_indices=tandem_kernels.document_mask(LENS),
        ).logits
        off = 0
        for n in LENS:
            solo = solo_model(input_ids=ids[:, off : off + n]).logits
            assert (packed[:, off : off + n] - solo).abs().max().item() <= 1e-5
            off += n
        # Without the mask bounds the later samples see the earlier ones: the kwarg is what isolates them.
        leaky = packed_model(input_ids=ids, position_ids=tandem_kernels.lengths_to_position_ids(LENS)).logits
        assert (leaky[:, LENS[0] :] - packed[:, LENS[0] :]).abs().max().item() > 1e-3


def test_kwarg_reaches_every_attention_layer(saved_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = tandem_kernels.register_hf_attention()
    model = _load(saved_model, name)
    seen: list[torch.Tensor | None] = []
    real = fm_hf.flashmask_attention_forward

    def spy(*args, startend_row_indices=None, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(startend_row_indices)
        return real(*args, startend_row_indices=startend_row_indices, **kwargs)

    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, name, spy)
    mask = tandem_kernels.document_mask(LENS)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, sum(LENS), dtype=torch.long), startend_row_indices=mask)
    assert len(seen) == model.config.num_hidden_layers
    assert all(s is mask for s in seen)


def test_plain_causal_and_cached_decoding_match_eager(saved_model: Path) -> None:
    name = tandem_kernels.register_hf_attention()
    model, eager = _load(saved_model, name), _load(saved_model, "eager")
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        assert (model(input_ids=ids).logits - eager(input_ids=ids).logits).abs().max().item() <= 1e-5
        a = model.generate(ids, max_new_tokens=4, do_sample=False)
        b = eager.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(a, b)


def test_training_gradients_match_solo(saved_model: Path) -> None:
    """Packed loss gradients equal the sum of the solo runs' gradients (backward through the torch path)."""
    name = tandem_kernels.register_hf_attention()
    model, solo = _load(saved_model, name), _load(saved_model, "eager")
    ids = torch.randint(0, 97, (1, sum(LENS)))
    out = model(
        input_ids=ids,
        position_ids=tandem_kernels.lengths_to_position_ids(LENS),
        startend_row_indices=tandem_kernels.document_mask(LENS),
    ).logits
    out.sum().backward()
    off = 0
    for n in LENS:
        solo(input_ids=ids[:, off : off + n]).logits.sum().backward()
        off += n
    for (pname, p), q in zip(model.named_parameters(), solo.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-4, rtol=1e-4), pname
