"""The one selector of the answer step: which candidate sentences answer, given a scorer's verdict.

The best-scored candidate that answers is the answer; it keeps the neighbours it needs to make
sense (the sentence before one that opens on "It", "This", "They"..., the lead-in of a list item,
the one after a sentence ending on a colon), and a second answering sentence of the same section
joins when it scores nearly as well. When none answers, the documents do not say, and the
sources closest to the question are listed to see also.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from services.agent.chunks import Chunk
from services.agent.grounding import strip_markers
from services.agent.reader.scorer import Scored
from services.common.candidates import BULLET, Candidate, balanced, clean, source_sentences
from services.common.text import WORD_RE, is_heading

SEE_ALSO = 3
# The sentences before and after the best one that an answer carries with it, on each side: the answer is a
# short passage, not one sentence. A manual often restates the question in one sentence and
# answers it in the next ("X is performed after Y." then "There are seven kinds of X: ..."), or
# gives the value after the description ("keyseq-timeout Specifies ..." then "The default value
# is 500."); the scorers rank the restatement first. Chosen on the tuning question sets
# (benchmarks/answers, ``reader_eval score``): RESULTS.md, "thirteen document sets". The agent's
# ``answer_passage`` setting.
PASSAGE = 1

# Sentence openings that lean on the sentence before them.
_ANAPHORA = frozenset(
    [
        "it",
        "its",
        "this",
        "that",
        "these",
        "those",
        "they",
        "them",
        "their",
        "such",
        "so",
        "then",
        "also",
        "however",
        "but",
        "both",
        "each",
        "here",
        "there",
        "otherwise",
        "instead",
        "thus",
        "hence",
        "which",
    ]
)


@dataclass
class Selection:
    """What the sources say to a question: the chosen sentences (with the neighbours they need),
    or nothing (``found`` false) and the sources closest to it."""

    found: bool
    picked: list[Candidate] = field(default_factory=list)
    see_also: list[int] = field(default_factory=list)  # source numbers, closest first
    best: Candidate | None = None
    ranked: list[Candidate] = field(default_factory=list)
    scorer: str = ""  # the scorer that judged ("reader:<model>", "rules")
    # The question's names that no source holds (the rules' check; empty otherwise).
    missing: list[str] = field(default_factory=list)


def _section(chunk: Chunk) -> str:
    section = chunk.section or chunk.metadata.get("section")
    return f"{chunk.document_id}#{section}" if section else chunk.document_id


def select(
    chunks: list[Chunk], candidates: list[Candidate], scored: Scored, passage: int = PASSAGE
) -> Selection:
    """The answer ``chunks`` give, from ``scored`` (one score and verdict per candidate): the best
    answering sentence with up to ``passage`` sentences of its source on each side."""
    for c, s in zip(candidates, scored.scores, strict=True):
        c.score = s
    answers = {id(c): a for c, a in zip(candidates, scored.answers, strict=True)}
    ranked = sorted(candidates, key=lambda c: (-c.score, c.source, c.position))
    closest: list[int] = []
    for c in ranked:
        if c.source not in closest:
            closest.append(c.source)
    closest += [n for n in range(1, len(chunks) + 1) if n not in closest]
    answering = [c for c in ranked if answers[id(c)]]
    if not answering:
        return Selection(
            False,
            see_also=closest[:SEE_ALSO],
            best=ranked[0] if ranked else None,
            ranked=ranked,
            scorer=scored.scorer,
            missing=scored.missing or [],
        )
    best = answering[0]
    picked = with_neighbours(best, chunks, passage)
    for c in answering[1:2]:
        # nearly as close, and (the rules' measure) holding as much of what the question asks for
        close = c.score >= best.score - scored.margin and c.focus >= best.focus
        close = close and _section(chunks[c.source - 1]) == _section(chunks[best.source - 1])
        if close and _key(c.text) not in {_key(p.text) for p in picked}:
            picked += [n for n in with_neighbours(c, chunks) if (n.source, n.position) not in places(picked)]
    picked.sort(key=lambda c: (c.source != best.source, c.source, c.position))  # as the source reads
    return Selection(True, picked=picked, best=best, ranked=ranked, scorer=scored.scorer)


def with_neighbours(best: Candidate, chunks: list[Chunk], passage: int = 0) -> list[Candidate]:
    """``best`` and the sentences of its source it leans on: the one before when it opens on a
    word pointing back, the one after when it ends on a colon (a list follows); then its passage,
    up to ``passage`` sentences before and after it, neither a heading nor a question nor across one."""
    raws = source_sentences(chunks[best.source - 1])
    out = _leaning(best, raws)
    for step in (-1, 1):
        k = best.position
        for _ in range(passage):
            k += step
            if not 0 <= k < len(raws) or is_heading(raws[k]):
                break
            text = clean(raws[k])
            if not text or not balanced(text) or text.endswith("?"):
                break
            if k not in {c.position for c in out}:
                out.append(Candidate(best.source, k, text))
    out.sort(key=lambda c: c.position)
    return out


def _leaning(best: Candidate, raws: list[str]) -> list[Candidate]:
    """``best`` and the neighbours it cannot be read without."""
    out = [best]
    if BULLET.match(raws[best.position]) and best.text[:1].islower():
        # A list item that continues its lead-in ("`tandem up` (what `make up` runs):" then
        # "3. on first start creates an API key ..."): the item alone has no subject.
        lead = _lead_in(raws, best.position)
        if lead is not None:
            out.insert(0, Candidate(best.source, lead, clean(raws[lead])))
    first = WORD_RE.findall(best.text)[:1]
    if len(out) == 1 and first and first[0].lower() in _ANAPHORA and best.position > 0:
        raw = raws[best.position - 1]
        prev = clean(raw)
        if prev and not is_heading(raw) and not prev.endswith("?") and balanced(prev):
            out.insert(0, Candidate(best.source, best.position - 1, prev))
    if best.text.rstrip().endswith(":") and best.position + 1 < len(raws):
        raw = raws[best.position + 1]
        nxt = clean(raw)
        if nxt and not is_heading(raw) and balanced(nxt):
            out.append(Candidate(best.source, best.position + 1, nxt))
    return out


def _lead_in(raws: list[str], position: int) -> int | None:
    """The sentence that introduces the list holding ``raws[position]``: the nearest one before
    it that is not a list item, when it ends on a colon (a short lead-in looks like a heading to
    ``is_heading``; a Markdown heading is never one)."""
    for k in range(position - 1, -1, -1):
        raw = raws[k]
        if BULLET.match(raw):
            continue
        text = clean(raw)
        if text.endswith(":") and not raw.lstrip().startswith("#") and balanced(text):
            return k
        return None
    return None


def places(picked: list[Candidate]) -> set[tuple[int, int]]:
    return {(p.source, p.position) for p in picked}


def _key(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def _cited(text: str, n: int) -> str:
    body = text.rstrip()
    end = body[-1] if body and body[-1] in ".!:" else "."
    # a list item's ";" or "," ends the answer: "... the next `tandem up` [1]."
    return f"{body.rstrip('.!:;,').rstrip()} [{n}]{end}"


def extractive_text(selection: Selection) -> tuple[str, list[int]]:
    """The picked sentences, the last of each source followed by its ``[n]``; the numbers used."""
    parts: list[str] = []
    for k, c in enumerate(selection.picked):
        last = k + 1 == len(selection.picked) or selection.picked[k + 1].source != c.source
        parts.append(_cited(c.text, c.source) if last else c.text)
    return " ".join(parts), sorted({c.source for c in selection.picked})


def _asked(question: str) -> str:
    """The question as what the documents do not say: "how many cores the setup needs" reads
    well enough as "how many cores does the setup need"."""
    text = strip_markers(question).strip().rstrip("?.! ").strip()
    if text[:1].isupper() and not text[1:2].isupper():
        text = text[0].lower() + text[1:]
    return text


def not_found_text(question: str, chunks: list[Chunk], see_also: list[int]) -> str:
    """ "Your documents do not say ...", then the closest sources by title and number."""
    text = f"Your documents do not say {_asked(question)}."
    if see_also:
        named = [f"{chunks[n - 1].title or chunks[n - 1].document_id} [{n}]" for n in see_also]
        text += " See also: " + "; ".join(named) + "."
    return text
