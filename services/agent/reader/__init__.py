"""The reader: the answer step that picks the source sentences answering a question.

``candidates`` (the sentences that can answer, with their section's heading path), a scorer
(``scorer.AnswerScorer``: the trained reader, or ``rules.RuleScorer`` as the fallback), the one
selector (``select``) and the answer's form (``forms``).
"""

from __future__ import annotations

from services.agent.chunks import Chunk
from services.agent.reader.candidates import answer_candidates
from services.agent.reader.forms import Asked, lead
from services.agent.reader.rules import RuleScorer, with_typed_neighbour
from services.agent.reader.scorer import AnswerScorer
from services.agent.reader.select import Selection, extractive_text, select


async def read(question: str, chunks: list[Chunk], scorer: AnswerScorer) -> Selection:
    """What ``chunks`` answer to ``question``, as ``scorer`` judges their sentences; its errors
    propagate (the caller falls back to another scorer)."""
    candidates = answer_candidates(chunks)
    scored = await scorer.score(question, chunks, candidates)
    selection = select(chunks, candidates, scored)
    if isinstance(scorer, RuleScorer):
        selection = with_typed_neighbour(question, selection, chunks)
    return selection


def answer_text(question: str, selection: Selection) -> tuple[str, list[int]]:
    """The extractive answer: its form's opening ("The default is 8080.", "Yes.") and the picked
    sentences, each source's last followed by its ``[n]``; the source numbers used."""
    text, numbers = extractive_text(selection)
    opening = lead(Asked.parse(question), [c.text for c in selection.picked])
    return (f"{opening} {text}" if opening else text), numbers
