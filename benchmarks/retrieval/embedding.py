"""Embedding backends side by side: torch fp32, ONNX Runtime fp32 and ONNX Runtime int8.

    python -m benchmarks.retrieval --backends torch,onnx,onnx-int8 [--docs all] [--repeat 3]
    python -m benchmarks.retrieval.embedding --backends torch,onnx,onnx-int8   # the same

For each backend, a collection created with that ``embedding_backend`` (as the service does):

* Quality: the ``--docs`` SciFact documents ingested (``all``, or N: every document judged by
  a test query plus the first others), then nDCG@10 of every test query, dense and hybrid
  (top_k 100, the scorer of ``tandem eval retrieval``).
* Speed: documents per second of ``Collection.write`` (chunking done beforehand; embedding,
  SQLite commit, FAISS and BM25 timed) of the first ``--time-docs`` documents into a fresh
  collection, in ``--repeat`` rounds that visit the backends in turn (rotating which goes first,
  so load swings on a shared machine hit all alike); the median round is reported.

Backend names: ``torch`` (float32), ``torch-auto`` (the service's default dtype: bf16 on CPUs
with native bf16), ``onnx``, ``onnx-int8``; int8 variants: ``onnx-int8+pt`` (per-tensor
weights), ``onnx-int8+ffn32`` (feed-forward output projections kept in fp32). Exports are made
once into ``--cache`` (default a temp folder, so the first run includes the export).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.retrieval.__main__ import SCIFACT


@dataclass(frozen=True)
class BackendSpec:
    label: str
    backend: str  # embedding_backend of the collection
    settings: dict[str, Any]  # RetrievalSettings fields


def parse_backends(text: str) -> list[BackendSpec]:
    specs = []
    for label in (x.strip() for x in text.split(",") if x.strip()):
        base, *flags = label.split("+")
        settings: dict[str, Any] = {"embedding_dtype": "float32"}
        if base == "torch-auto":
            base, settings["embedding_dtype"] = "torch", "auto"
        if base not in ("torch", "onnx", "onnx-int8"):
            raise SystemExit(f"--backends: unknown backend {label!r} (torch, torch-auto, onnx, onnx-int8)")
        for flag in flags:
            if base != "onnx-int8" or flag not in ("pt", "ffn32"):
                raise SystemExit(f"--backends: unknown variant {label!r} (onnx-int8+pt, onnx-int8+ffn32)")
            settings["onnx_int8_per_channel" if flag == "pt" else "onnx_int8_fp32_ffn_output"] = flag != "pt"
        specs.append(BackendSpec(label, base, settings))
    return specs


def compare_backends(
    specs: list[BackendSpec],
    *,
    docs_arg: str = "all",
    time_docs: int = 300,
    repeat: int = 3,
    cache: Path | None = None,
    beir: Path = SCIFACT,
) -> dict[str, float]:
    """Figures ``<label>_docs_per_s``, ``<label>_dense_ndcg10``, ``<label>_hybrid_ndcg10``;
    prints a Markdown table."""
    from services.cli.eval_retrieval import documents_in_order, load_beir
    from services.common.ranking import ndcg_at
    from services.retrieval.config import RetrievalSettings
    from services.retrieval.core.collection import InputDocument
    from services.retrieval.core.registry import CollectionManager

    data = load_beir(beir)
    docs = [json.loads(line) for line in data.corpus.open() if line.strip()]
    docs = [d for d in docs if str(d.get("text", "")).strip()]
    if docs_arg != "all":
        # A subset that keeps every document a test query is judged on, then the corpus in order
        # as distractors: the same for every backend, so their nDCG differences stay meaningful
        # (the absolute figures are higher than on the whole corpus).
        judged = {d for rel in data.qrels.values() for d in rel}
        keep = sorted(docs, key=lambda d: str(d["_id"]) not in judged)[: int(docs_arg)]
        ids = {str(d["_id"]) for d in keep}
        docs = [d for d in docs if str(d["_id"]) in ids]
    inputs = [InputDocument(str(d["_id"]), d["text"], d.get("title") or "", {}) for d in docs]
    queries = list(data.queries.items())
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        managers = {}
        for spec in specs:
            home = Path(tmp) / spec.label
            m = CollectionManager(home, RetrievalSettings(**spec.settings), [])
            if cache is not None:
                m.onnx_cache = cache
            t0 = time.perf_counter()
            m.create("bench", "scifact", embedding_backend=spec.backend)  # type: ignore[arg-type]
            col = m.get("bench", "scifact")
            col.embedder.embed_documents(["warm up"] * 8)
            print(
                f"{spec.label}: embedder ready in {time.perf_counter() - t0:.1f}s "
                f"({col.config.embedding_backend}, {getattr(col.embedder, 'onnx_path', 'torch')})",
                flush=True,
            )
            managers[spec.label] = m

        # Speed first, while nothing else is cached: interleaved rounds, median.
        timed = inputs[:time_docs]
        rates: dict[str, list[float]] = {s.label: [] for s in specs}
        for r in range(repeat):
            order = specs[r % len(specs) :] + specs[: r % len(specs)]
            for spec in order:
                m = managers[spec.label]
                m.create("bench", f"t{r}", embedding_backend=spec.backend)  # type: ignore[arg-type]
                col = m.get("bench", f"t{r}")
                records = col.prepare(timed)
                t0 = time.perf_counter()
                for s in range(0, len(records), 64):
                    col.write(records[s : s + 64])
                rates[spec.label].append(len(records) / (time.perf_counter() - t0))
                m.delete("bench", f"t{r}")
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), flush=True)
        for label, xs in rates.items():
            if xs:
                figures[f"{label}_docs_per_s"] = statistics.median(xs)

        # Quality: the whole corpus, every test query.
        for spec in specs:
            col = managers[spec.label].get("bench", "scifact")
            records = col.prepare(inputs)
            t0 = time.perf_counter()
            for s in range(0, len(records), 64):
                col.write(records[s : s + 64])
            figures[f"{spec.label}_full_ingest_docs_per_s"] = len(records) / (time.perf_counter() - t0)
            # --repeat 0: the speed column is this one ingestion's.
            figures.setdefault(f"{spec.label}_docs_per_s", figures[f"{spec.label}_full_ingest_docs_per_s"])
            for mode in ("dense", "hybrid"):
                scores = []
                for qid, q in queries:
                    hits = col.search(q, top_k=100, mode=mode)
                    ranked = documents_in_order([{"document_id": h.document_id} for h in hits])
                    scores.append(ndcg_at(ranked, data.qrels[qid], 10))
                figures[f"{spec.label}_{mode}_ndcg10"] = statistics.fmean(scores)
            print(
                f"{spec.label}: {len(records)} documents at "
                f"{figures[f'{spec.label}_full_ingest_docs_per_s']:.1f} docs/s, "
                f"dense nDCG@10 {figures[f'{spec.label}_dense_ndcg10']:.4f}, "
                f"hybrid {figures[f'{spec.label}_hybrid_ndcg10']:.4f}",
                flush=True,
            )
        for m in managers.values():
            m.close_all()

    base = specs[0].label
    print(
        f"\n{len(docs)} SciFact documents ({'all' if docs_arg == 'all' else 'judged + distractors'}), "
        f"{len(queries)} test queries; speed: "
        + (f"median of {repeat} rounds of {len(timed)} documents" if repeat else "the whole ingestion")
        + f"; ratios against {base}\n"
    )
    print("| backend | docs/s | speed-up | dense nDCG@10 | diff | hybrid nDCG@10 | diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    b_rate, b_dense, b_hyb = (figures[f"{base}_{k}"] for k in ("docs_per_s", "dense_ndcg10", "hybrid_ndcg10"))
    for spec in specs:
        rate, dense, hyb = (
            figures[f"{spec.label}_{k}"] for k in ("docs_per_s", "dense_ndcg10", "hybrid_ndcg10")
        )
        print(
            f"| {spec.label} | {rate:.1f} | {rate / b_rate:.2f}x | {dense:.4f} | {dense - b_dense:+.4f} "
            f"| {hyb:.4f} | {hyb - b_hyb:+.4f} |"
        )
    return figures


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--time-docs", type=int, default=300, help="documents per timed ingestion round")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds per backend (median)")
    ap.add_argument("--beir", type=Path, default=SCIFACT, help="BEIR folder for the comparison (SciFact)")
    ap.add_argument("--onnx-cache", type=Path, help="where ONNX exports are kept (default: a temp folder)")


def compare_from_args(args: argparse.Namespace, backends: str, docs: str) -> dict[str, float]:
    """``compare_backends`` with the options of ``add_arguments``."""
    opts = {k: getattr(args, k) for k in ("time_docs", "repeat", "beir")}
    return compare_backends(parse_backends(backends), docs_arg=docs, cache=args.onnx_cache, **opts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--backends", default="torch,onnx,onnx-int8", help="comma-separated, first is the baseline"
    )
    ap.add_argument("--docs", default="all", help="SciFact documents for nDCG, or 'all' (5183)")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    add_arguments(ap)
    args = ap.parse_args()
    figures = compare_from_args(args, args.backends, args.docs)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
