"""Kernels for Tandem: attention for packed sequences (FlashMask-style) and other fused ops.

``kernels.flashmask_attention`` and the mask builders are the public surface; see
``docs/kernels.md``.
"""

from kernels.flashmask import (
    choose_impl,
    document_mask,
    flashmask_attention,
    lengths_to_cu_seqlens,
    lengths_to_position_ids,
    prefix_lm_document_mask,
    register_hf_attention,
    shared_question_mask,
    shared_question_position_ids,
    sliding_window_mask,
)

__all__ = [
    "choose_impl",
    "document_mask",
    "flashmask_attention",
    "lengths_to_cu_seqlens",
    "lengths_to_position_ids",
    "prefix_lm_document_mask",
    "register_hf_attention",
    "shared_question_mask",
    "shared_question_position_ids",
    "sliding_window_mask",
]
