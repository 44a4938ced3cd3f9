"""Retrieval backends side by side: the embedded one (SQLite + FAISS + BM25) and Milvus (on a
Milvus Lite server started here), same documents, same chunks, same embeddings.

    python -m benchmarks.retrieval.backends [--docs all] [--queries 300] [--beir PATH]

* Ingestion: ``Collection.write`` in batches of 64 documents, with the embeddings computed once
  beforehand and served from memory, so the figure is the backend's own cost (store, indexes,
  network), not the embedding model's (identical on both).
* Quality: nDCG@10 of every SciFact test query per mode (top_k 100), with the scorer of
  ``tandem eval retrieval``. Milvus should be within 0.01 of embedded.
* Query latency: p50/p95 per mode, in process, after a warm-up (query embedding included).

Ratios are Milvus / embedded from the same run: > 1 means Milvus is faster (or scores higher).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.retrieval.__main__ import SCIFACT, percentile


class CachedEmbedder:
    """The collection's embedder, with document vectors precomputed (``Embedder`` protocol)."""

    def __init__(self, inner: Any, vectors: dict[str, np.ndarray]) -> None:
        self.inner = inner
        self.vectors = vectors
        self.dim = inner.dim

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        return np.stack([self.vectors[t] for t in texts])

    def embed_query(self, text: str) -> np.ndarray:
        return self.inner.embed_query(text)  # type: ignore[no-any-return]

    def token_offsets(self, text: str) -> list[tuple[int, int]]:
        return self.inner.token_offsets(text)  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", default="all", help="SciFact documents to ingest, or 'all' (5183)")
    ap.add_argument("--queries", type=int, default=300, help="test queries per mode")
    ap.add_argument("--beir", type=Path, default=SCIFACT, help="BEIR folder (SciFact)")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()

    from services.cli.eval_retrieval import documents_in_order, load_beir
    from services.common.ranking import ndcg_at
    from services.retrieval.config import RetrievalSettings
    from services.retrieval.core.collection import InputDocument
    from services.retrieval.core.registry import CollectionManager
    from services.retrieval.milvus import lite
    from tests.helpers.servers import free_port

    data = load_beir(args.beir)
    docs = [json.loads(line) for line in data.corpus.open() if line.strip()]
    docs = [d for d in docs if str(d.get("text", "")).strip()]
    if args.docs != "all":
        docs = docs[: int(args.docs)]
    queries = list(data.queries.items())[: args.queries]
    inputs = [InputDocument(str(d["_id"]), d["text"], d.get("title") or "", {}) for d in docs]
    figures: dict[str, float] = {}

    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        server = lite.start(Path(tmp) / "milvus" / "bench.db", port)
        try:
            managers = {
                name: CollectionManager(
                    Path(tmp) / name,
                    RetrievalSettings(backend=name, milvus_uri=f"http://127.0.0.1:{port}"),  # type: ignore[arg-type]
                    [],
                )
                for name in ("embedded", "milvus")
            }
            cols = {}
            for name, m in managers.items():
                m.create("bench", "scifact")
                cols[name] = m.get("bench", "scifact")
            base = cols["embedded"]
            records = base.prepare(inputs)
            texts = list({c.index_text: None for r in records for c in r.chunks})
            t0 = time.perf_counter()
            vecs = base.embedder.embed_documents(texts)
            print(
                f"{len(docs)} documents, {len(texts)} chunks embedded once in {time.perf_counter() - t0:.0f}s"
            )
            cached = dict(zip(texts, vecs, strict=True))
            for name, col in cols.items():
                col.embedder = CachedEmbedder(col.embedder, cached)
                t0 = time.perf_counter()
                for s in range(0, len(records), 64):
                    col.write(records[s : s + 64])
                figures[f"{name}_chunks_per_s"] = len(texts) / (time.perf_counter() - t0)
                print(f"{name}: ingestion {figures[f'{name}_chunks_per_s']:.0f} chunks/s", flush=True)
            for mode in ("dense", "sparse", "hybrid"):
                lat: dict[str, list[float]] = {name: [] for name in cols}
                nd: dict[str, list[float]] = {name: [] for name in cols}
                for _, q in queries[:5]:
                    for col in cols.values():
                        col.search(q, top_k=100, mode=mode)
                for i, (qid, q) in enumerate(queries):
                    # alternate which backend goes first, so load swings hit both alike
                    for name in list(cols)[:: 1 if i % 2 else -1]:
                        t0 = time.perf_counter()
                        hits = cols[name].search(q, top_k=100, mode=mode)
                        lat[name].append((time.perf_counter() - t0) * 1000)
                        ranked = documents_in_order([{"document_id": h.document_id} for h in hits])
                        nd[name].append(ndcg_at(ranked, data.qrels[qid], 10))
                for name in cols:
                    figures[f"{name}_{mode}_ndcg10"] = statistics.fmean(nd[name])
                    figures[f"{name}_{mode}_p50_ms"] = statistics.median(lat[name])
                    figures[f"{name}_{mode}_p95_ms"] = percentile(lat[name], 0.95)
                    print(
                        f"{name} {mode}: nDCG@10 {figures[f'{name}_{mode}_ndcg10']:.4f}, "
                        f"p50 {figures[f'{name}_{mode}_p50_ms']:.1f} ms",
                        flush=True,
                    )
            for m in managers.values():
                m.close_all()
        finally:
            server.terminate()
            server.wait(30)

    print("\n| figure | embedded | milvus | milvus / embedded |\n| --- | --- | --- | --- |")
    e, v = figures["embedded_chunks_per_s"], figures["milvus_chunks_per_s"]
    print(f"| ingestion (chunks/s, embedding excluded) | {e:.0f} | {v:.0f} | {v / e:.2f} |")
    for mode in ("dense", "sparse", "hybrid"):
        e, v = figures[f"embedded_{mode}_ndcg10"], figures[f"milvus_{mode}_ndcg10"]
        print(f"| {mode} nDCG@10 | {e:.4f} | {v:.4f} | {v - e:+.4f} (difference) |")
        for q in ("p50", "p95"):
            e, v = figures[f"embedded_{mode}_{q}_ms"], figures[f"milvus_{mode}_{q}_ms"]
            print(f"| {mode} query {q} (ms) | {e:.1f} | {v:.1f} | {e / v:.2f} (speed) |")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
