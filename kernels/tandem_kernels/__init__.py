"""Kernels for Tandem: attention for packed sequences (FlashMask-style) and other fused ops.

``tandem_kernels.flashmask_attention`` and the mask builders are the public surface; see
``docs/kernels.md``. The list of names lives once, in ``tandem_kernels.flashmask``.
"""

from tandem_kernels import flashmask
from tandem_kernels.flashmask import *  # noqa: F403 - re-export the public surface

__all__ = list(flashmask.__all__)
