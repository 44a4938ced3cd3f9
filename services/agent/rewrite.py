"""History-aware query rewriting: a follow-up question becomes a standalone search query.

The rule-based rewriter needs no model call (so the first token is not delayed by
one): when the question leans on the conversation ("what about its license?",
"and the second one?"), the content words of the last user turns are added to the
search query. A model-based rewriter can replace it (any ``QueryRewriter``).
"""

from __future__ import annotations

import re
from typing import Protocol

from services.agent.protocol import Message
from services.common.text import content_terms

FOLLOW_UP_RE = re.compile(
    r"\b(it|its|it's|they|them|their|this|that|these|those|he|she|his|her|one|ones|former|latter|"
    r"above|same|there|more|else|also)\b|^(and|but|what about|how about|why|so)\b",
    re.IGNORECASE,
)


class QueryRewriter(Protocol):
    async def rewrite(self, question: str, history: list[Message]) -> str: ...


class HistoryRewriter:
    def __init__(self, max_turns: int = 2, short_question_terms: int = 3) -> None:
        self.max_turns = max_turns
        self.short_question_terms = short_question_terms

    async def rewrite(self, question: str, history: list[Message]) -> str:
        users = [m.text() for m in history if m.role == "user"][-self.max_turns :]
        if not users:
            return question
        own = content_terms(question, stemmed=False)
        if not FOLLOW_UP_RE.search(question) and len(own) > self.short_question_terms:
            return question
        extra = [t for text in users for t in content_terms(text, stemmed=False) if t not in own]
        if not extra:
            return question
        return f"{question} ({' '.join(dict.fromkeys(extra))})"
