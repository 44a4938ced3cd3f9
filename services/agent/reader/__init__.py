"""The reader: the answer step that picks the source sentences answering a question.

``candidates`` (the sentences that can answer, with their section's heading path), the question
parsed once (``question.Asked``: its kind, terms, names and what kind of thing it asks for), a
scorer (``scorer.AnswerScorer``: the trained reader, or ``rules.RuleScorer`` as the fallback), the
one selector (``select``) and the answer's form (``forms``). ``read`` parses the question at its
top and every scorer and rule reads that one ``Asked``.
"""

from __future__ import annotations

from services.agent.chunks import Chunk
from services.agent.reader.forms import lead
from services.agent.reader.question import Asked, parsed
from services.agent.reader.rules import RuleScorer, with_typed_neighbour
from services.agent.reader.scorer import AnswerScorer
from services.agent.reader.select import PASSAGE, Selection, extractive_text, select
from services.common.candidates import answer_candidates


async def read(
    question: str | Asked, chunks: list[Chunk], scorer: AnswerScorer, passage: int = PASSAGE
) -> Selection:
    """What ``chunks`` answer to ``question``, as ``scorer`` judges their sentences, the best one
    with up to ``passage`` sentences on each side; the scorer's errors propagate (the caller falls
    back to another scorer). The question is parsed here, once."""
    asked = parsed(question)
    candidates = answer_candidates(chunks)
    scored = await scorer.score(asked, chunks, candidates)
    selection = select(chunks, candidates, scored, passage)
    if isinstance(scorer, RuleScorer):
        selection = with_typed_neighbour(asked, selection, chunks)
    return selection


def answer_text(question: str | Asked, selection: Selection) -> tuple[str, list[int]]:
    """The extractive answer: its form's opening ("The default is 8080.", "Yes.") and the picked
    sentences, each source's last followed by its ``[n]``; the source numbers used."""
    text, numbers = extractive_text(selection)
    # the best sentence decides a yes/no question; its passage's neighbours only surround it
    best = selection.best
    first = [best] if best is not None else []
    opening = lead(parsed(question), [c.text for c in first + [c for c in selection.picked if c is not best]])
    return (f"{opening} {text}" if opening else text), numbers
