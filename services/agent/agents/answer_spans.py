"""The answers a forced final step may give after a tool result: spans copied from that result.

After a good tool result the agent's next step may only finish (``finish_after_result``). With
``copy_answer`` that final answer is also constrained to a span of the result (an ``enum`` in the
step's JSON schema): SmolLM2-135M, asked to answer from three search passages, otherwise writes a
word from the question or a number from nowhere ("honey", "1889 metres" for the Nile), while it
picks the right span among the result's own words far more often. The tool result is then the
answer's source by construction, which is what the agent claims of it.
"""

from __future__ import annotations

import re

MAX_WORDS = 8  # the longest span offered, in words
MAX_SPANS = 600  # bounds the grammar: about 75 words of passages at 8 spans a word
_SOURCE_TAG = re.compile(r"^\[[^\]]{1,80}\]\s*")  # document_search's "[doc-id] " line prefix
_EDGE = "\"'`,;:.!?()[]{}<>"


def answer_spans(observation: str, max_words: int = MAX_WORDS, limit: int = MAX_SPANS) -> list[str]:
    """Every run of 1 to ``max_words`` words within one line of ``observation`` (punctuation at
    its ends removed), shortest first and in reading order, at most ``limit``; empty when the
    observation has no words (the caller then leaves the answer free)."""
    lines = [_SOURCE_TAG.sub("", line).split() for line in observation.splitlines()]
    seen: dict[str, None] = {}
    for n in range(1, max_words + 1):
        for words in lines:
            for i in range(len(words) - n + 1):
                span = " ".join(words[i : i + n]).strip(_EDGE)
                if span and len(span) <= 200:
                    seen.setdefault(span, None)
                if len(seen) >= limit:
                    return list(seen)
    return list(seen)
