"""The sentences of the retrieved sources that can stand as an answer: the reader's candidates.

A candidate is never a heading, a question, a table's header or rule, code, or a fragment a
chunk boundary cut. Each keeps its *context*: the heading path of its section (or its
document's title), so a reader can tell a sentence under "Options > port" from the same words
elsewhere, and a definition list's term stays with its description.

They are read from any ``Passage``: the agent's chunks, and retrieval's hits when a search asks
for their sentences scored against its query (so the reader needs no second call).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from services.common.text import WORD_RE, is_heading, sentences, unwrap

BULLET = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")


class Passage(Protocol):
    """What the candidates of a source are read from: its text (offset ``start`` in its
    document), its section's heading path and its document's title."""

    @property
    def text(self) -> str: ...
    @property
    def start(self) -> int: ...
    @property
    def section(self) -> str: ...
    @property
    def title(self) -> str: ...
    @property
    def metadata(self) -> Mapping[str, Any]: ...


@dataclass
class Candidate:
    source: int  # 1-based number of its source, as the prompt numbered it
    position: int  # its place among the source's sentences
    text: str  # as shown in an answer (list bullets and table pipes removed)
    context: str = ""  # its section's heading path, else its document's title
    score: float = 0.0  # the scorer's: higher answers better
    # the fallback scorer's parts (services/agent/reader/rules.py)
    similarity: float = 0.0
    focus: float = 0.0


def context_of(chunk: Passage) -> str:
    """The heading path a reader reads a chunk's sentences under: its section, else its title."""
    section = chunk.section or str(chunk.metadata.get("section") or "")
    return section or chunk.title


def balanced(text: str) -> bool:
    return (
        text.count("(") == text.count(")")
        and text.count("[") == text.count("]")
        and text.count("`") % 2 == 0
        and text.count("**") % 2 == 0
    )


def clean(sentence: str) -> str:
    """A sentence as an answer shows it: no list bullet or bold marks, table cells joined by a dash."""
    text = BULLET.sub("", sentence.strip())
    if text.startswith("|"):
        cells = [c.strip().replace("\x00", "|") for c in text.replace("\\|", "\x00").strip("|").split("|")]
        text = " — ".join(c for c in cells if c and c != "—")
    return text.replace("**", "").strip()


_FENCE = re.compile(r"^[ \t]*```.*?(?:^[ \t]*```[^\n]*$|\Z)", re.MULTILINE | re.DOTALL)
# Code fenced within a line (a table cell's example, flattened by the HTML parser: "start the
# collector on that port: ``` ferrule-collector 9100 ``` Then ..."): read as inline code, so the
# sentence around it can still answer.
_INLINE_FENCE = re.compile(r"```[ \t]*([^`\n]+?)[ \t]*```")


def _sentence_spans(chunk: Passage) -> tuple[str, list[tuple[int, int]]]:
    """A chunk's text with wrapped lines joined and fenced code left out, and its sentences' spans."""
    text = chunk.text
    if text.count("```") % 2:
        text = text[text.index("```") + 3 :]  # the chunk starts inside a code block
    flat = unwrap(_FENCE.sub("\n", _INLINE_FENCE.sub(r"`\1`", text)))
    return flat, sentences(flat)


def source_sentences(chunk: Passage) -> list[str]:
    """The sentences of a chunk's text (wrapped lines joined, fenced code left out)."""
    flat, spans = _sentence_spans(chunk)
    return [flat[s:e] for s, e in spans]


def _asking(flat: str, spans: list[tuple[int, int]]) -> set[int]:
    """The places of the sentences that open a question on their line: "I restored X with Ferrule
    and the files came back empty. Does Ferrule handle such volumes?" (an FAQ's question row) is
    the question, not its answer."""
    return {
        i
        for i in range(len(spans) - 1)
        if flat[spans[i + 1][0] : spans[i + 1][1]].rstrip(" |").endswith("?")
        and "\n" not in flat[spans[i][1] : spans[i + 1][0]]
    }


def answer_candidates(chunks: Sequence[Passage]) -> list[Candidate]:
    """The sentences of ``chunks`` that can be an answer, in source order."""
    out: list[Candidate] = []
    for n, chunk in enumerate(chunks, start=1):
        context = context_of(chunk)
        flat, spans = _sentence_spans(chunk)
        raws = [flat[s:e] for s, e in spans]
        asking = _asking(flat, spans)
        for i, raw in enumerate(raws):
            text = clean(raw)
            if not text or is_heading(raw) or text.rstrip().endswith("?") or "`" * 3 in raw:
                continue  # a heading, a question, code
            if i in asking:
                continue  # the first half of a question
            if not balanced(text):
                continue  # a piece of a sentence the chunk boundary or a line break cut
            if i == 0 and text[0].islower() and chunk.start > 0:
                continue  # the chunk boundary cut it: its start is in the previous chunk
            if i == len(raws) - 1 and not re.search(r"[.!:)`\"'|]\s*$", raw.strip()):
                continue  # cut at the chunk's end
            if len(WORD_RE.findall(text)) < 4:
                continue  # "See below." says nothing
            out.append(Candidate(n, i, text, context))
    return out
