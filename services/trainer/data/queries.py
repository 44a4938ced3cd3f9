"""Generated queries (embedder jobs' ``generate_queries``): passages sampled from the job's
corpus, and the one short question a chat model writes for each, as training pairs.

A passage is a chunk as the retrieval service cuts it (``services/common/chunking.py``:
Markdown sections, then windows of ``CHUNK_WORDS`` word tokens with ``CHUNK_OVERLAP`` overlap),
its heading path (the title, then the headings) opening its text as a collection indexes it.
This module is the pure part (sampling, the prompt, reading the reply);
``services/trainer/questions.py`` makes the calls to the inference service (the job's worker).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

CHUNK_WORDS = 256  # the retrieval service's default chunk_size (its tokens are close to words)
CHUNK_OVERLAP = 32
COPIED_CHARS = 60  # a verbatim span of the passage longer than this is a copy, not a question
MAX_QUERY_CHARS = 300  # a longer reply is no search query (the model ran on, or copied the passage)

PROMPT = (
    "Write one short question that a person might type into a search box and that the passage "
    "below answers. Reply with the question only, on one line.\n\nPassage:\n{passage}"
)
_LABEL = re.compile(r"^\s*(?:[-*\d.)\s]+)?(?:question|query|q)\s*[:.)-]\s*", re.IGNORECASE)
# A reply about the passage rather than a question for it (small models write these often:
# 44 of 235 kept replies of SmolLM2-135M on SciFact began so; benchmarks/RESULTS.md).
_SUMMARY = re.compile(r"^(?:the|this)\s+(?:passage|study|article|text|paper|abstract)\b", re.IGNORECASE)


@dataclass(frozen=True)
class Passage:
    document: str  # the document it comes from (collection id, or the dataset's corpus_id)
    text: str  # heading path, newline, the chunk's text


def passages(documents: list[tuple[str, str, str]]) -> list[Passage]:
    """Every chunk of ``(id, title, text)`` documents, in order."""
    from services.common.chunking import chunk_text

    out: list[Passage] = []
    for doc, title, text in documents:
        for start, end, headings in chunk_text(text, size=CHUNK_WORDS, overlap=CHUNK_OVERLAP):
            context = " > ".join(p for p in (title.strip(), *headings) if p)
            piece = text[start:end].strip()
            out.append(Passage(doc, f"{context}\n{piece}" if context else piece))
    return out


def sample(all_passages: list[Passage], count: int, seed: int) -> list[Passage]:
    """``count`` passages drawn without replacement (seeded), in corpus order; all if fewer."""
    if count >= len(all_passages):
        return list(all_passages)
    picked = sorted(random.Random(seed).sample(range(len(all_passages)), count))
    return [all_passages[i] for i in picked]


def query_of(reply: str, passage: str) -> str | None:
    """The question in a model's reply: its first non-empty line that is not a preamble ending in
    ":", without a "Question:" label or quotes; ``None`` when nothing usable is left (empty, too
    long, a sentence copied from the passage: a few words of it are a fair keyword query, a copied
    sentence is not; or a summary of the passage: "This study shows ...")."""
    # a line ending in ":" is a preamble ("Passage:", "A person might type:"): the question, if
    # any, is on a later line
    lines = (_LABEL.sub("", ln.strip()).strip().strip("\"'“”").strip() for ln in reply.splitlines())
    line = next((ln for ln in lines if ln and not ln.endswith(":")), "")
    if not line or len(line) > MAX_QUERY_CHARS or (len(line) > COPIED_CHARS and line in passage):
        return None
    if _SUMMARY.match(line):
        return None
    return line


def questions(picked: list[Passage], replies: list[str]) -> list[tuple[Passage, str]]:
    """Each passage with the question its reply gives, in order; a passage whose reply gives
    none is left out, and so is a question asked before (compared case-blind): the same text
    twice in a batch is no negative for itself, and small models repeat stock questions."""
    out: list[tuple[Passage, str]] = []
    seen: set[str] = set()
    for p, reply in zip(picked, replies, strict=True):
        query = query_of(reply, p.text)
        if query is not None and query.casefold() not in seen:
            seen.add(query.casefold())
            out.append((p, query))
    return out
