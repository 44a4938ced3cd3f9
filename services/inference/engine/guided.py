"""Grammar-constrained decoding with xgrammar (see docs/inference.md for why xgrammar).

One ``GuidedCompiler`` per engine holds the tokenizer's token table and xgrammar's
compiler (which caches compiled grammars, so a schema repeated across requests compiles
once). Each constrained sequence gets its own ``GrammarMatcher``: before sampling, the
scheduler fills that row's token bitmask and applies it to that row's logits only, so
constrained and free sequences share a batch; after sampling the matcher is advanced
with the accepted token, and the sequence ends when the grammar terminates.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Iterable
from typing import Any

import torch

from services.inference.engine.types import GuidedDecoding, InvalidParams


class GuidedCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                # the stop tokens are the engine's end-of-text ids: a finished grammar allows
                # only those, and the scheduler ends the sequence on them
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, spec: GuidedDecoding) -> Any:
        """Compile ``spec`` (cached by xgrammar); a grammar it cannot compile is a 400."""
        compiler = self._get()
        try:
            if spec.json_schema is not None:
                return compiler.compile_grammar(schema_grammar(spec.json_schema))
            if spec.grammar is not None:
                return compiler.compile_grammar(spec.grammar)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its parser's message
            # its messages start with "[time] /project/cpp/file.cc:line: ": the client needs the rest
            reason = re.sub(
                r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            )
            raise InvalidParams(
                f"{spec.param}: the grammar could not be compiled: {reason or type(exc).__name__}", spec.param
            ) from None
        raise InvalidParams(f"{spec.param}: no grammar given", spec.param)

    @staticmethod
    def matcher(compiled: Any) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)


def apply_masks(logits: torch.Tensor, matchers: list[tuple[int, Any]]) -> None:
    """Mask, in place, the rows of ``logits`` that have a matcher to the tokens their grammar allows."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for row, matcher in matchers:
        matcher.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=[row for row, _ in matchers])


# xgrammar 0.2.9 writes length-bounded strings (minLength/maxLength) with the character class
# below, which lets raw control characters (U+0000-U+001F) into a JSON string: the output
# then does not parse. Its unbounded strings use the right class, substituted here.
_LOOSE_CHAR = r"[^\"\\\r\n]"
_JSON_CHAR = r"[^\0-\x1f\"\\]"


@functools.lru_cache(maxsize=256)
def schema_grammar(schema: str) -> str:
    """The EBNF grammar of a JSON Schema: compact JSON (no free whitespace, so a model cannot
    pad the output forever), the schema's own semantics (no implied additionalProperties)."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=False)
    return str(grammar).replace(_LOOSE_CHAR, _JSON_CHAR)
