"""The groundedness guard: is each answer sentence supported by a source, and is the answer usable?

A small model (SmolLM2-135M) often writes an answer that says nothing ("The answer is:"),
loops on one sentence, or drifts away from its sources. The guard judges the answer
sentence by sentence against the sources the prompt numbered, with lexical overlap and, for
the sentences that overlap misses, the collection's own embedder (no extra model):

- a sentence is *supported* when most of its fact words (its content words, citation markers,
  filler such as "answer" and the question's own words aside) appear in one source sentence,
  or (``with_embeddings``) when its embedding is close enough to one source sentence's; either
  way only a source holding all of the sentence's names and numbers can support it;
- an answer is *degenerate* when it is empty, repeats a sentence, is a bare preamble
  (nothing beyond filler and the question's words), or has no supported sentence.

A degenerate answer is replaced by an *extractive* one: the source sentences that best
answer the question, each followed by its ``[n]``. A partly supported answer is kept, and
its unsupported sentences are reported so a client can show them dimmed.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from services.agent.citations import MARKER_RE, TITLE_MARKER_RE
from services.common.text import content_terms, overlap, sentences, stem, unwrap

# Words that carry no fact of their own in an answer ("Based on the sources, the answer is ...").
FILLER = frozenset(
    content_terms(
        "answer answers question questions source sources based according provided following given "
        "information context document documents text mention mentioned state stated say says "
        "know sure sorry unfortunately here help"
    )
)

Verdict = Literal["ok", "partial", "empty", "repeated", "preamble", "unsupported"]


@dataclass
class SentenceCheck:
    text: str
    start: int
    end: int
    support: float  # share of the sentence's fact words (beyond the question's) in its best source sentence
    source: int | None  # 1-based number of that source
    substantive: bool  # says something beyond filler and the question's own words
    # Cosine similarity to the closest source sentence holding its names and numbers: only
    # computed (``with_embeddings``) for a substantive sentence the overlap does not support.
    similarity: float | None = None

    @property
    def supported(self) -> bool:
        return self.source is not None


@dataclass
class GroundingReport:
    verdict: Verdict
    sentences: list[SentenceCheck] = field(default_factory=list)

    @property
    def degenerate(self) -> bool:
        return self.verdict not in ("ok", "partial")

    @property
    def unsupported(self) -> list[SentenceCheck]:
        return [s for s in self.sentences if s.substantive and not s.supported]

    @property
    def share(self) -> float | None:
        """Supported share of the substantive sentences (None when there are none)."""
        judged = [s for s in self.sentences if s.substantive]
        return sum(s.supported for s in judged) / len(judged) if judged else None


def strip_markers(text: str) -> str:
    return TITLE_MARKER_RE.sub(" ", MARKER_RE.sub(" ", text))


def _key(sentence: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", strip_markers(sentence).lower()))


def repeats_sentence(answer: str, min_chars: int = 8) -> bool:
    """True when one sentence of ``answer`` (markers ignored) occurs twice."""
    seen: set[str] = set()
    for s, e in sentences(answer):
        key = _key(answer[s:e])
        if len(key) < min_chars:
            continue
        if key in seen:
            return True
        seen.add(key)
    return False


def _source_sentences(texts: list[str]) -> list[tuple[int, str]]:
    out = []
    for n, text in enumerate(texts, start=1):
        flat = unwrap(text)
        out += [(n, flat[s:e]) for s, e in sentences(flat)]
    return out


def names(sentence: str) -> set[str]:
    """The sentence's names and numbers (lower-cased): capitalised words after the first, and
    numbers ("source 2" aside). A supported sentence must not bring one its source lacks."""
    text = re.sub(r"\bsources?\s*\d+", " ", strip_markers(sentence), flags=re.IGNORECASE)
    words = re.findall(r"[A-Za-z0-9]+", text)
    out = {w.lower() for w in words if any(ch.isdigit() for ch in w)}
    out |= {w.lower() for w in words[1:] if w[0].isupper() and len(w) > 1 and stem(w) not in FILLER}
    return out


def _vocab(sources: list[str]) -> list[set[str]]:
    return [{w.lower() for w in re.findall(r"[A-Za-z0-9]+", src)} for src in sources]


def check(
    answer: str, question: str, sources: list[str], min_support: float = 0.5, repeated: bool = False
) -> GroundingReport:
    """Judges ``answer`` against ``sources`` (texts, numbered from 1 as the prompt numbered them)."""
    asked = set(content_terms(question))
    pool = _source_sentences(sources)
    vocab = _vocab(sources)
    checks: list[SentenceCheck] = []
    for s, e in sentences(answer):
        text = answer[s:e]
        terms = [t for t in content_terms(strip_markers(text)) if t not in FILLER]
        facts = [t for t in terms if t not in asked]
        best, where = 0.0, None
        named = names(text)
        if facts:
            # Judged on what the sentence adds to the question: a misspelt name is not supported
            # just because the sentence repeats the question's words around it; and a source
            # supports it only if it holds all its names and numbers (not another town's mayor,
            # not a depth the model made up).
            for n, src in pool:
                if not named <= vocab[n - 1]:
                    continue
                score = overlap(facts, src)
                if score > best:
                    best, where = score, n
        checks.append(
            SentenceCheck(
                text=text,
                start=s,
                end=e,
                support=best,
                source=where if best >= min_support and facts else None,
                substantive=bool(facts),
            )
        )
    return _verdict(answer, checks, repeated)


def _verdict(answer: str, checks: list[SentenceCheck], repeated: bool) -> GroundingReport:
    if not strip_markers(answer).strip():
        return GroundingReport("empty", checks)
    if repeated or repeats_sentence(answer):
        return GroundingReport("repeated", checks)
    if not any(c.substantive for c in checks):
        return GroundingReport("preamble", checks)
    if not any(c.supported for c in checks):
        return GroundingReport("unsupported", checks)
    return GroundingReport(
        "partial" if any(not c.supported for c in checks if c.substantive) else "ok", checks
    )


# Texts in, one L2-normalised vector per text out (the agent calls retrieval's
# /v1/collections/{name}/embed: the collection's own embedder).
Embed = Callable[[list[str]], Awaitable[list[list[float]]]]

# Measured with all-MiniLM-L6-v2 (the default embedder) on the invented facts (benchmarks/RESULTS.md,
# "answers"): of the paraphrases of a fact that the overlap misses, 0.85 keeps 22/27 (seed 1) and
# 23/27 (seed 2) and no unsupported claim about the same entity (0/39 on each); 0.8 keeps one or two
# more paraphrases but also "Mount X is the highest mountain in the region" (0.81). The model's own
# unsupported sentences score at most 0.65.
MIN_SIMILARITY = 0.85


async def with_embeddings(
    report: GroundingReport,
    answer: str,
    sources: list[str],
    embed: Embed,
    min_similarity: float = MIN_SIMILARITY,
) -> GroundingReport:
    """``report`` (from ``check``) with the sentences the overlap missed judged again by embedding:
    one is supported when its cosine similarity to a source sentence (of a source holding all its
    names and numbers) reaches ``min_similarity``. Calls ``embed`` once, and only when some
    substantive sentence is unsupported and could still be; its errors propagate."""
    if report.verdict in ("empty", "repeated", "preamble", "ok"):
        return report  # nothing that a similarity could change
    pool = _source_sentences(sources)
    vocab = _vocab(sources)
    todo: list[tuple[SentenceCheck, list[int]]] = []
    for c in report.sentences:
        if c.substantive and not c.supported:
            named = names(c.text)
            candidates = [i for i, (n, _) in enumerate(pool) if named <= vocab[n - 1]]
            if candidates:
                todo.append((c, candidates))
    if not todo:
        return report
    wanted = sorted({i for _, cands in todo for i in cands})
    texts = [strip_markers(c.text).strip() for c, _ in todo] + [pool[i][1].strip() for i in wanted]
    vectors = np.asarray(await embed(texts), dtype=np.float32)
    if vectors.shape[0] != len(texts):
        raise ValueError(f"the embedder returned {vectors.shape[0]} vectors for {len(texts)} texts")
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    row = {i: len(todo) + k for k, i in enumerate(wanted)}
    for k, (c, cands) in enumerate(todo):
        sims = [(float(vectors[k] @ vectors[row[i]]), -i) for i in cands]
        best, neg_i = max(sims)
        c.similarity = best
        if best >= min_similarity:
            c.source = pool[-neg_i][0]
    return _verdict(answer, report.sentences, repeated=False)
