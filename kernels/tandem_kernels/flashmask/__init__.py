"""FlashMask-style attention for packed sequences (column-wise row-range masks).

Modules: ``masks`` (builders), ``bounds`` (the internal form and tile summaries),
``reference`` (dense mask + SDPA), ``torch_impl`` (blockwise online softmax in torch),
``triton_impl`` (Triton kernels), ``api`` (``flashmask_attention``), ``hf`` (transformers).
"""

from tandem_kernels.flashmask.api import choose_impl, flashmask_attention
from tandem_kernels.flashmask.hf import register_hf_attention
from tandem_kernels.flashmask.masks import (
    document_mask,
    lengths_to_cu_seqlens,
    lengths_to_position_ids,
    prefix_lm_document_mask,
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
