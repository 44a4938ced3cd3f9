"""The groundedness guard's similarity threshold, measured (``grounding.MIN_SIMILARITY``).

``python -m benchmarks.answers.calibrate [--seed 1] [ANSWERS.json ...]``

For each invented fact of ``--seed`` (50, services/cli/factset.py) two sentences are written: a
paraphrase of the asked fact (supported, in words the source does not use) and a claim about the
same entity that no source makes (unsupported, in the same shape). Each is judged as the guard
judges it, against every document of the set: word overlap first; for what overlap misses, the
cosine similarity (all-MiniLM-L6-v2, the default collection embedder, in process) to the closest
source sentence holding its names and numbers. Prints, per threshold, how many missed paraphrases
it keeps and how many unsupported claims it lets through. ``ANSWERS.json`` files (written by
``benchmarks.answers``, e.g. an ``after-noguard`` variant) add the model's own sentences,
labelled by whether they state the expected answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path

THRESHOLDS = (0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9)

# (pattern of the asked sentence, paraphrase, unsupported claim): groups of the pattern fill both.
SHAPES = [
    (
        r"The (.+ loom) was invented by (.+) in (\d+)\.",
        "{1} built the very first {0} back in {2}.",
        "The {0} was used to weave silk carpets for the royal court.",
    ),
    (
        r"The town of (\w+) lies on the river (\w+)\.",
        "The river {1} flows right through the town of {0}.",
        "The town of {0} lies in a wide valley full of farms.",
    ),
    (
        r"(.+ Works) makes (.+) in its factory in (\w+)\.",
        "The factory of {0} in {2} produces {1} for customers.",
        "{0} makes {other_product} in its factory in {2}.",
    ),
    (
        r"The (\w+) festival is held every (\w+) in (\w+)\.",
        "Each year during {1}, the people of {2} celebrate the {0} festival.",
        "The {0} festival celebrates the harvest with music and dancing.",
    ),
    (
        r"The first mayor of (\w+) was (.+), elected in (\d+)\.",
        "{1} became the first person to serve as mayor of {0}, in {2}.",
        "The first mayor of {0} was very popular with the farmers.",
    ),
    (
        r"Lake (\w+) reaches a depth of (\d+) metres\.",
        "At its deepest point, Lake {0} is {1} metres deep.",
        "Lake {0} is a popular spot for swimming and fishing.",
    ),
    (
        r"The (.+) is a small lizard that feeds on (.+)\.",
        "The diet of the {0} consists mainly of {1}.",
        "The {0} is a small lizard that feeds on {other_food}.",
    ),
    (
        r"The ship (\w+) was launched in (\d+) at the docks of (\w+)\.",
        "In {1} the ship {0} first went into the water at {2}.",
        "The ship {0} sank in a storm on its first voyage.",
    ),
    (
        r"(Mount \w+) was first climbed by (.+)\.",
        "The first person to reach the top of {0} was {1}.",
        "{0} is the highest mountain in the whole region.",
    ),
]


def pairs(fact_sentence: str) -> list[tuple[bool, str]]:
    from services.cli.factset import _FOODS, _PRODUCTS

    for pattern, supported, unsupported in SHAPES:
        if m := re.fullmatch(pattern, fact_sentence):
            g = m.groups()
            other = {
                "other_product": next(p for p in _PRODUCTS if p not in g),
                "other_food": next(f for f in _FOODS if f not in g),
            }
            return [(True, supported.format(*g, **other)), (False, unsupported.format(*g, **other))]
    raise ValueError(f"no shape for {fact_sentence!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("answers", nargs="*", type=Path, help="benchmarks.answers JSON files of this seed")
    args = ap.parse_args(argv)

    from sentence_transformers import SentenceTransformer

    from services.agent.grounding import check, with_embeddings
    from services.cli.factset import make_facts, states
    from services.common.embedding_models import resolve_model_path

    model = SentenceTransformer(str(resolve_model_path("all-MiniLM-L6-v2", [], param="model")), device="cpu")

    async def embed(texts: list[str]) -> list[list[float]]:
        return [list(map(float, v)) for v in model.encode(texts, normalize_embeddings=True)]

    facts = make_facts(50, args.seed)
    documents = [f.text for f in facts]
    by_question = {f.question: f for f in facts}
    # (set, label, supported by overlap, similarity when overlap missed)
    rows: list[tuple[str, bool, bool, float | None]] = []

    def judge(kind: str, text: str, question: str, label: Callable[[str], bool]) -> None:
        lexical = check(text, question, documents)
        # A threshold above 1 keeps every verdict lexical and records each missed sentence's similarity.
        report = asyncio.run(with_embeddings(lexical, text, documents, embed, min_similarity=2.0))
        for c in report.sentences:
            if c.substantive:
                rows.append((kind, label(c.text), c.supported, c.similarity))

    for fact in facts:
        for supported, text in pairs(fact.sentence):
            judge("written", text, fact.question, lambda _s, v=supported: v)
    for path in args.answers:
        for answer in json.loads(path.read_text())["answers"]:
            fact = by_question[answer["question"]]
            judge("model", answer["answer"], fact.question, lambda s, f=fact: states(s, f.answer))

    for kind, title in (
        ("written", "written paraphrases / unsupported claims"),
        ("model", "the model's sentences"),
    ):
        mine = [r for r in rows if r[0] == kind]
        if not mine:
            continue
        missed = [r for r in mine if not r[2]]
        pos, neg = [r for r in missed if r[1]], [r for r in missed if not r[1]]
        print(
            f"{title} (seed {args.seed}): {len(mine)} sentences, {len(mine) - len(missed)} supported by overlap"
        )
        print("  threshold  supported ones overlap missed, kept  unsupported ones let through")
        for t in THRESHOLDS:
            kept = sum(1 for r in pos if r[3] is not None and r[3] >= t)
            through = sum(1 for r in neg if r[3] is not None and r[3] >= t)
            print(f"  {t:>9}  {kept:>3}/{len(pos):<33} {through:>3}/{len(neg)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
