"""A guard against small models that loop.

SmolLM2-135M at temperature 0 often repeats its first sentence until the token cap.
The guard watches the stream and says stop once a finished sentence repeats an
earlier one, so the answer ends there (and the inference slot is freed) instead of
filling the screen with copies.
"""

from __future__ import annotations

import re

# A model may wrap lines mid-sentence, so a newline alone does not end one.
_SENTENCE_END = re.compile(r"[.!?:;](?=\s)")


class RepetitionGuard:
    def __init__(self, min_chars: int = 8) -> None:
        # Short sentences ("Yes.") legitimately recur.
        self.min_chars = min_chars
        self.seen: set[str] = set()
        self.pending = ""
        self.repeated: str | None = None

    def feed(self, text: str) -> bool:
        """Add streamed text; True once a finished sentence repeats an earlier one."""
        self.pending += text
        while (match := _SENTENCE_END.search(self.pending)) is not None:
            sentence = self.pending[: match.end()].strip()
            self.pending = self.pending[match.end() :]
            key = " ".join(sentence.lower().split())
            if len(key) < self.min_chars:
                continue
            if key in self.seen:
                self.repeated = sentence
                return True
            self.seen.add(key)
        return False

    def trim(self, answer: str) -> str:
        """``answer`` without the repeated copy (and what followed it)."""
        if self.repeated is None:
            return answer
        cut = answer.rfind(self.repeated)
        return answer[:cut].rstrip() if cut > 0 else answer
