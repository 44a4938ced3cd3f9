"""Incremental detokenisation with stop strings.

Tokens arrive one at a time; text is released as soon as it is final: never half a
UTF-8 character (a byte-level token may end mid-character, decoded as U+FFFD), and
never the first characters of what may turn out to be a stop string (held back until
it is clear). OpenAI's API leaves the stop string itself out of the output.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens kept as decoding context, so the first generated token's leading space
# (SentencePiece-style tokenizers) comes out right.
_CONTEXT = 4


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.released = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip))

    def add(self, token_id: int) -> None:
        """Take one generated token; sets ``stopped`` when a stop string appeared."""
        if self.stopped:
            return
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            start = max(0, len(self.text) - self.hold)
            self.text += new
            if self.stop:
                cut = min((i for s in self.stop if (i := self.text.find(s, start)) != -1), default=-1)
                if cut != -1:
                    self.text = self.text[:cut]
                    self.stopped = True

    def flush(self, final: bool) -> str:
        """Text that is now certain (all of it when ``final``), not released before."""
        if final and not self.stopped and self.read_offset < len(self.ids):
            # the sequence ended inside a multi-byte character: release what decodes
            tail = self._decode(self.ids[self.prefix_offset :])[
                len(self._decode(self.ids[self.prefix_offset : self.read_offset])) :
            ]
            self.text += tail.rstrip("\ufffd")
            self.read_offset = len(self.ids)
        upto = len(self.text) if (final or self.stopped) else max(self.released, len(self.text) - self.hold)
        out = self.text[self.released : upto]
        self.released = max(self.released, upto)
        return out
