"""Chunking properties: size limit in model tokens, exact offsets, full coverage, bounded
overlap starting at word boundaries, headings respected, deterministic content ids."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from services.retrieval.core.chunking import chunk_text, make_chunks, regex_offsets, sections
from services.retrieval.core.embedder import SentenceTransformerEmbedder

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
]


def random_text(seed: int, paragraphs: int = 8) -> str:
    rng = random.Random(seed)
    paras = []
    for p in range(paragraphs):
        if rng.random() < 0.3:
            paras.append("#" * rng.randint(1, 3) + f" Heading {p}")
        sents = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 25))).capitalize() + "."
            for _ in range(rng.randint(1, 8))
        ]
        paras.append(" ".join(sents))
    return "\n\n".join(paras)


@pytest.fixture(scope="module")
def tokenizer(tiny_embedder: Path) -> SentenceTransformerEmbedder:
    return SentenceTransformerEmbedder(tiny_embedder, dtype="float32")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("size", "overlap"), [(16, 4), (40, 10), (128, 0)])
def test_chunk_properties(tokenizer: SentenceTransformerEmbedder, seed: int, size: int, overlap: int) -> None:
    text = random_text(seed)
    offsets = tokenizer.token_offsets
    chunks = chunk_text(text, size=size, overlap=overlap, offsets=offsets)
    assert chunks
    covered = [False] * len(text)
    for start, end, _ in chunks:
        piece = text[start:end]
        assert piece.strip() == piece, "chunks are trimmed to tokens"
        n_tokens = len([t for t in offsets(piece) if t[1] > t[0]])
        assert n_tokens <= size, (n_tokens, size)
        for i in range(start, end):
            covered[i] = True
    # every non-space character is in some chunk
    assert all(covered[i] for i, ch in enumerate(text) if not ch.isspace())
    # overlap: consecutive chunks within a section share at most `overlap` tokens, and start on a word
    for (s1, e1, h1), (s2, e2, h2) in itertools.pairwise(chunks):
        assert s2 > s1 and e2 > e1
        if s2 < e1:
            assert h1 == h2, "no overlap across sections"
            shared = len([t for t in offsets(text[s2:e1]) if t[1] > t[0]])
            assert shared <= overlap
        assert s2 == 0 or text[s2 - 1].isspace()


def test_headings_are_section_boundaries() -> None:
    text = "Intro line.\n\n# Setup\n\nInstall it.\n\n## Linux\n\nUse apt.\n\n# Usage\n\nRun it."
    secs = sections(text)
    assert [s.headings for s in secs] == [(), ("Setup",), ("Setup", "Linux"), ("Usage",)]
    chunks = make_chunks("d", text, title="Guide", size=100, overlap=0)
    assert [c.text for c in chunks] == [
        "Intro line.",
        "# Setup\n\nInstall it.",
        "## Linux\n\nUse apt.",
        "# Usage\n\nRun it.",
    ]
    assert chunks[2].context == "Guide > Setup > Linux"
    # a heading inside a code fence is not a heading
    fenced = "# Real\n\n```\n# not a heading\n```\n\nmore"
    assert [s.headings for s in sections(fenced)] == [("Real",)]
    # an empty heading directly above its subheading is folded into it
    nested = "# Top\n\n## Sub\n\nBody."
    assert [(s.start, s.headings) for s in sections(nested)] == [(0, ("Top", "Sub"))]


def test_prefers_paragraph_then_sentence_boundaries() -> None:
    para1 = " ".join(["one"] * 30) + "."
    para2 = " ".join(["two"] * 30) + "."
    chunks = chunk_text(f"{para1}\n\n{para2}", size=45, overlap=0, offsets=regex_offsets)
    assert chunks[0][1] == len(para1)  # cut at the paragraph break
    sent = "First sentence here is fine. " * 6
    chunks = chunk_text(sent.strip(), size=12, overlap=0, offsets=regex_offsets)
    assert all(sent[c[0] : c[1]].endswith(".") for c in chunks[:-1])


def test_ids_are_content_derived() -> None:
    text = random_text(3)
    a = make_chunks("doc", text, title="T", size=32, overlap=8)
    b = make_chunks("doc", text, title="T", size=32, overlap=8)
    assert [c.chunk_id for c in a] == [c.chunk_id for c in b]
    assert len({c.chunk_id for c in a}) == len(a)
    other_doc = make_chunks("doc2", text, title="T", size=32, overlap=8)
    assert not {c.chunk_id for c in a} & {c.chunk_id for c in other_doc}
    edited = make_chunks("doc", text + "\n\nA new closing paragraph.", title="T", size=32, overlap=8)
    assert {c.chunk_id for c in a[:-1]} <= {c.chunk_id for c in edited}  # untouched chunks keep their ids


def test_overlap_must_be_smaller_than_size() -> None:
    with pytest.raises(ValueError, match="overlap"):
        chunk_text("x y z", size=4, overlap=4)
