"""Hugging Face wiring: ``attn_implementation="flashmask"`` for Llama-family models.

Usage::

    from tandem_kernels import register_hf_attention, document_mask, lengths_to_position_ids
    name = register_hf_attention()                       # "flashmask"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
    logits = model(input_ids=ids, position_ids=lengths_to_position_ids(lens),
                   startend_row_indices=document_mask(lens)).logits

``startend_row_indices`` travels through the model's ``**kwargs`` (``TransformersKwargs``)
down to every attention layer, which calls :func:`flashmask_attention_forward` with it.
Because "flashmask" is registered in ``AttentionInterface`` only (not in
``AttentionMaskInterface``), transformers builds no dense 4-D mask for it: the attention
function gets ``attention_mask=None`` and the packing is described by the mask bounds
alone. A 2-D padding ``attention_mask`` is therefore ignored: pack (or give pad tokens a
segment of their own, as the builders' ``total_len`` does) instead of padding.

Without ``startend_row_indices`` the layer is plain causal attention; when the keys are
longer than the queries (decoding with a KV cache) the causal diagonal is aligned to the
bottom right, as ``sdpa`` does.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem_kernels.flashmask.api import flashmask_attention

NAME = "flashmask"


def _decode_bounds(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """Bottom-right causal mask as non-causal ``[LTS, UTE]``: row ``i`` is at absolute position
    ``i + sk - sq`` and sees key ``j`` iff ``j <= i + sk - sq``, so rows ``i < j - (sk - sq)`` are masked."""
    cols = torch.arange(sk, device=device, dtype=torch.int32)
    ute = torch.clamp(cols - (sk - sq), min=0)
    lts = torch.full_like(cols, sq)
    return torch.stack([lts, ute], dim=-1).view(1, 1, sk, 2)


def flashmask_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    startend_row_indices: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: ``query [B, Hq, Sq, D]``, ``key``/``value`` ``[B, Hk, Sk, D]``
    -> (``[B, Sq, Hq, D]``, no attention weights)."""
    if dropout and module.training:
        raise ValueError(f"flashmask attention does not implement attention dropout (got dropout={dropout})")
    causal = bool(getattr(module, "is_causal", True))
    sq, sk = query.shape[2], key.shape[2]
    mask = startend_row_indices
    if mask is None and causal and sq != sk:
        mask, causal = _decode_bounds(sq, sk, query.device), False
    elif mask is not None and sq != sk:
        raise ValueError(
            f"startend_row_indices needs as many queries as keys (got {sq} queries, {sk} keys); "
            "it is meant for packed training/scoring without a KV cache"
        )
    out = flashmask_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        mask,
        causal=causal,
        softmax_scale=scaling,
    )
    return out, None


def _let_flashmask_load() -> None:
    """transformers (5.x) treats every ``attn_implementation`` containing "flash" as a flash-attention
    kernel and, when a model is built, tries to import one for it (from ``flash_attn`` or the Hub),
    which fails for "flashmask". Skip that preload for our name only; everything else is untouched."""
    import transformers.modeling_utils as mu

    original = mu.lazy_import_flash_attention
    if getattr(original, "_tandem_flashmask", False):
        return

    def lazy_import_flash_attention(implementation: str | None, *args: Any, **kwargs: Any) -> Any:
        if implementation == NAME:
            return None  # the callers in modeling_utils only preload; they ignore the result
        return original(implementation, *args, **kwargs)

    lazy_import_flash_attention._tandem_flashmask = True  # type: ignore[attr-defined]
    mu.lazy_import_flash_attention = lazy_import_flash_attention


def register_hf_attention() -> str:
    """Register :func:`flashmask_attention_forward` with transformers' ``AttentionInterface``
    under ``"flashmask"`` (idempotent) and return that name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, flashmask_attention_forward)
    _let_flashmask_load()
    return NAME
