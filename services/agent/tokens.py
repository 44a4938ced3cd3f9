"""Counting prompt tokens, so prompts fit the model's context window."""

from __future__ import annotations

import logging
import math
from functools import lru_cache
from typing import Any, Protocol

log = logging.getLogger("tandem.agent.tokens")


class TokenCounter(Protocol):
    def count(self, text: str) -> int: ...


class EstimatingCounter:
    """Upper-bound estimate without a tokenizer: BPE vocabularies of chat models average
    well above 3 bytes per token on English text, so this over-counts and prompts stay in budget."""

    def __init__(self, bytes_per_token: float = 3.0) -> None:
        self.bytes_per_token = bytes_per_token

    def count(self, text: str) -> int:
        return math.ceil(len(text.encode("utf-8")) / self.bytes_per_token)


class HFTokenCounter:
    """Exact counts with the model's own tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


@lru_cache(maxsize=4)
def load_counter(tokenizer_path: str) -> TokenCounter:
    if not tokenizer_path:
        return EstimatingCounter()
    from transformers import AutoTokenizer

    return HFTokenCounter(AutoTokenizer.from_pretrained(tokenizer_path))
