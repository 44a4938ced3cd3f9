"""Mask builders: each drawn mask in the docstrings, checked cell by cell against the dense form."""

from __future__ import annotations

import pytest
import tandem_kernels
import torch
from tandem_kernels.flashmask.reference import dense_mask


def _drawing(mask: torch.Tensor, causal: bool) -> list[str]:
    s = mask.shape[2]
    allowed = dense_mask(mask, causal=causal, batch=1, sq=s, sk=s, device=mask.device)[0, 0]
    return [" ".join("x" if a else "." for a in row.tolist()) for row in allowed]


def test_document_mask_with_padding_segment() -> None:
    m = tandem_kernels.document_mask([3, 2], total_len=6)
    assert m.dtype == torch.int32 and m.shape == (1, 1, 6, 1)
    assert m.flatten().tolist() == [3, 3, 3, 5, 5, 6]
    assert _drawing(m, causal=True) == [
        "x . . . . .",
        "x x . . . .",
        "x x x . . .",
        ". . . x . .",
        ". . . x x .",
        ". . . . . x",
    ]


def test_shared_question_mask() -> None:
    m = tandem_kernels.shared_question_mask([(2, 2, 2)])
    assert m.flatten().tolist() == [6, 6, 4, 4, 6, 6]
    assert _drawing(m, causal=True) == [
        "x . . . . .",
        "x x . . . .",
        "x x x . . .",
        "x x x x . .",
        "x x . . x .",
        "x x . . x x",
    ]
    assert tandem_kernels.shared_question_position_ids([(2, 2, 2)]).tolist() == [[0, 1, 2, 3, 2, 3]]
    # several triples per pack are isolated; total_len pads
    two = tandem_kernels.shared_question_mask([(1, 1, 1), (2, 1, 1)], total_len=9)
    assert two.flatten().tolist() == [3, 2, 3, 7, 7, 6, 7, 9, 9]


def test_prefix_lm_document_mask() -> None:
    m = tandem_kernels.prefix_lm_document_mask([4, 2], [2, 1])
    assert m.shape == (1, 1, 6, 2)
    assert m[0, 0, :, 0].tolist() == [4, 4, 4, 4, 6, 6]
    assert m[0, 0, :, 1].tolist() == [0, 0, 2, 3, 4, 5]
    assert _drawing(m, causal=False) == [
        "x x . . . .",
        "x x . . . .",
        "x x x . . .",
        "x x x x . .",
        ". . . . x .",
        ". . . . x x",
    ]


def test_sliding_window_mask() -> None:
    m = tandem_kernels.sliding_window_mask(5, window=2)
    assert m.flatten().tolist() == [2, 3, 4, 5, 5]
    assert _drawing(m, causal=True) == [
        "x . . . .",
        "x x . . .",
        ". x x . .",
        ". . x x .",
        ". . . x x",
    ]
    per_doc = tandem_kernels.sliding_window_mask([3, 3], window=2)
    assert per_doc.flatten().tolist() == [2, 3, 3, 5, 6, 6]


def test_lengths_helpers() -> None:
    assert tandem_kernels.lengths_to_position_ids([3, 1, 2]).tolist() == [[0, 1, 2, 0, 0, 1]]
    assert tandem_kernels.lengths_to_position_ids([2], total_len=4).tolist() == [[0, 1, 0, 1]]
    cu = tandem_kernels.lengths_to_cu_seqlens(torch.tensor([3, 1, 2]))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 4, 6]


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: tandem_kernels.document_mask([3, -1]), "-1"),
        (lambda: tandem_kernels.document_mask([3, 4], total_len=5), "total_len=5"),
        (lambda: tandem_kernels.prefix_lm_document_mask([3], [4]), "prefix length 4"),
        (lambda: tandem_kernels.prefix_lm_document_mask([3, 2], [1]), "1 prefix lengths for 2"),
        (lambda: tandem_kernels.sliding_window_mask(4, window=0), "window"),
        (lambda: tandem_kernels.shared_question_mask([(1, -2, 1)]), "triple"),
    ],
)
def test_bad_lengths_are_named(call, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        call()
