"""Retrieval benchmark: ingestion throughput and query latency against a LangChain baseline.

    python -m benchmarks.retrieval [--docs 1000|all] [--queries 300] [--with-fp32]
    python -m benchmarks.retrieval --backends torch,onnx,onnx-int8 [--docs all] [--repeat 3]

Without ``--backends`` the run ends with the embedding-backend comparison of
``benchmarks/retrieval/embedding.py`` (torch fp32, ONNX, ONNX int8: documents per second and
nDCG@10 on the whole of SciFact); with it, that comparison runs alone.

Both sides get the same SciFact documents cut into the same chunks (Tandem's chunker):

* Tandem: ``Collection.write`` as the service runs it (embed with the collection's
  sentence-transformers model in the service's dtype, commit to SQLite with fsync, update
  FAISS and BM25), in batches of 64 documents.
* Baseline: langchain-community ``FAISS.from_texts`` with langchain-huggingface
  ``HuggingFaceEmbeddings`` on the same model folder (its defaults: float32, batch 32).

Query latency: every SciFact test query once per mode (top_k 10), in process, after a
warm-up; the baseline is ``FAISS.similarity_search`` (dense only: LangChain has no built-in
hybrid over FAISS). Ratios > 1 mean Tandem is better.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SCIFACT = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "scifact"


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def load(docs_arg: str, n_queries: int) -> tuple[list[dict[str, str]], list[str]]:
    docs = [json.loads(line) for line in (SCIFACT / "corpus.jsonl").open() if line.strip()]
    if docs_arg != "all":
        docs = docs[: int(docs_arg)]
    qrels = {
        line.split("\t")[0]
        for line in (SCIFACT / "qrels" / "test.tsv").open()
        if not line.startswith("query-id")
    }
    queries = [
        q["text"]
        for q in (json.loads(line) for line in (SCIFACT / "queries.jsonl").open() if line.strip())
        if q["_id"] in qrels
    ]
    return docs, queries[:n_queries]


def main() -> None:
    from benchmarks.retrieval.embedding import add_arguments
    from benchmarks.retrieval.embedding import compare_from_args as compare

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--docs",
        help="SciFact documents to ingest, or 'all' (5183); default 1000, and 'all' for --backends",
    )
    ap.add_argument("--queries", type=int, default=300, help="test queries timed per mode")
    ap.add_argument("--with-fp32", action="store_true", help="also time Tandem with a float32 model")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    ap.add_argument(
        "--backends",
        help="only compare these embedding backends (e.g. torch,onnx,onnx-int8; first is the baseline)",
    )
    add_arguments(ap)
    args = ap.parse_args()
    if args.backends:
        figures = compare(args, args.backends, args.docs or "all")
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))
        return
    args.docs = args.docs or "1000"

    import torch

    from services.retrieval.config import RetrievalSettings
    from services.retrieval.core.collection import InputDocument
    from services.retrieval.core.registry import CollectionManager

    docs, queries = load(args.docs, args.queries)
    print(f"SciFact: {len(docs)} documents, {len(queries)} queries; torch threads {torch.get_num_threads()}")
    inputs = [InputDocument(d["_id"], d["text"], d.get("title") or "", {}) for d in docs]
    rows: list[tuple[str, str, float, str]] = []
    figures: dict[str, float] = {}

    def tandem_run(dtype: str, home: Path) -> tuple[float, object]:
        manager = CollectionManager(home, RetrievalSettings(embedding_dtype=dtype), [home])  # type: ignore[arg-type]
        manager.create("bench", "scifact")
        col = manager.get("bench", "scifact")
        col.embedder.embed_documents(["warm up"] * 4)
        records = col.prepare(inputs)
        n_chunks = sum(len(r.chunks) for r in records)
        t0 = time.perf_counter()
        for s in range(0, len(records), 64):
            col.write(records[s : s + 64])
        dt = time.perf_counter() - t0
        return n_chunks / dt, (col, records, n_chunks, str(col.embedder.torch_dtype))  # type: ignore[attr-defined]

    with tempfile.TemporaryDirectory() as tmp:
        rate, (col, records, n_chunks, dtype_name) = tandem_run("auto", Path(tmp) / "a")  # type: ignore[misc]
        print(f"tandem ingestion: {n_chunks} chunks, {rate:.1f} chunks/s ({dtype_name})")
        figures["tandem_chunks_per_s"] = rate
        if args.with_fp32:
            rate32, _ = tandem_run("float32", Path(tmp) / "b")
            figures["tandem_fp32_chunks_per_s"] = rate32
            print(f"tandem ingestion fp32: {rate32:.1f} chunks/s")

        from langchain_community.vectorstores import FAISS
        from langchain_huggingface import HuggingFaceEmbeddings

        texts = [c.index_text for r in records for c in r.chunks]
        metas = [{"document_id": r.doc_id, "start": c.start, "end": c.end} for r in records for c in r.chunks]
        lc_emb = HuggingFaceEmbeddings(
            model_name=str(col.config.model_path), encode_kwargs={"normalize_embeddings": True}
        )
        lc_emb.embed_documents(["warm up"] * 4)
        t0 = time.perf_counter()
        store = FAISS.from_texts(texts, lc_emb, metadatas=metas)
        base_rate = len(texts) / (time.perf_counter() - t0)
        figures["langchain_chunks_per_s"] = base_rate
        print(f"langchain ingestion: {base_rate:.1f} chunks/s")

        rows.append(("ingestion", "chunks/s", rate, f"{base_rate:.1f}"))
        if args.with_fp32:
            rows.append(
                (
                    "ingestion (tandem fp32)",
                    "chunks/s",
                    figures["tandem_fp32_chunks_per_s"],
                    f"{base_rate:.1f}",
                )
            )

        for q in queries[:5]:  # warm-up
            store.similarity_search(q, k=10)
            col.search(q, top_k=10, mode="hybrid")
        lat_base = []
        for q in queries:
            t0 = time.perf_counter()
            store.similarity_search(q, k=10)
            lat_base.append((time.perf_counter() - t0) * 1000)
        b50, b95 = statistics.median(lat_base), percentile(lat_base, 0.95)
        figures.update({"langchain_dense_p50_ms": b50, "langchain_dense_p95_ms": b95})
        for mode in ("dense", "sparse", "hybrid"):
            lat = []
            for q in queries:
                t0 = time.perf_counter()
                col.search(q, top_k=10, mode=mode)
                lat.append((time.perf_counter() - t0) * 1000)
            p50, p95 = statistics.median(lat), percentile(lat, 0.95)
            figures.update({f"tandem_{mode}_p50_ms": p50, f"tandem_{mode}_p95_ms": p95})
            rows.append((f"query {mode} p50", "ms", p50, f"{b50:.2f}"))
            rows.append((f"query {mode} p95", "ms", p95, f"{b95:.2f}"))
        col.close(checkpoint=False)

    print()
    print("| measure | unit | tandem | langchain | ratio (tandem better if > 1) |")
    print("| --- | --- | --- | --- | --- |")
    for name, unit, ours, base in rows:
        b = float(base)
        ratio = ours / b if unit == "chunks/s" else b / ours
        print(f"| {name} | {unit} | {ours:.2f} | {base} | {ratio:.2f}x |")
    print("\n(query baselines are LangChain's dense similarity_search for every mode)\n")
    figures.update(compare(args, "torch,onnx,onnx-int8", "all"))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
