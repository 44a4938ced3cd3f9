"""``tandem eval retrieval --beir DIR``: a BEIR data set through a running retrieval service.

The corpus is ingested over the HTTP API (``POST /v1/collections/{name}/documents``),
every test query is searched in each mode, and the ranking (chunks collapsed to their
documents, best first) is scored against ``qrels/test.tsv``: nDCG@10, Recall@100, MRR@10.

``--embedder NAME_OR_PATH`` (repeatable) compares embedders: one collection per embedder
(``beir-<folder>-<embedder>``): a model folder under the service's model roots (or a base
model name) is its ``embedding_model``; a fine-tuned ``ft-emb-...`` is switched to with
``PATCH /v1/collections/{name}`` while the collection is empty. The same queries go through
each, one table. ``--queries FILE`` keeps only the query ids listed in FILE (one a
line): the held-out half of a fine-tune's split, say.
"""

from __future__ import annotations

import csv
import json
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import typer

from services.common.ranking import first_seen, mrr_at, ndcg_at, recall_at
from services.common.upstream import UpstreamReply

MODES = ("dense", "sparse", "hybrid")


@dataclass
class BeirSet:
    corpus: Path
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]


def load_beir(root: Path, split: str = "test") -> BeirSet:
    corpus = root / "corpus.jsonl"
    qfile = root / "queries.jsonl"
    qrels_file = root / "qrels" / f"{split}.tsv"
    for p in (corpus, qfile, qrels_file):
        if not p.exists():
            raise FileNotFoundError(
                f"{p} is missing (BEIR layout: corpus.jsonl, queries.jsonl, qrels/{split}.tsv)"
            )
    qrels: dict[str, dict[str, int]] = {}
    with qrels_file.open() as f:
        for row in csv.reader(f, delimiter="\t"):
            if not row or row[0] == "query-id":
                continue
            qrels.setdefault(row[0], {})[row[1]] = int(row[2])
    queries = {}
    with qfile.open() as f:
        for line in f:
            if line.strip():
                q = json.loads(line)
                if str(q["_id"]) in qrels:
                    queries[str(q["_id"])] = q["text"]
    return BeirSet(corpus, queries, qrels)


def corpus_batches(path: Path, size: int) -> Iterator[list[dict[str, object]]]:
    batch: list[dict[str, object]] = []
    with path.open() as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            if not str(d.get("text", "")).strip():
                continue
            batch.append({"id": str(d["_id"]), "text": d["text"], "title": d.get("title") or None})
            if len(batch) == size:
                yield batch
                batch = []
    if batch:
        yield batch


def documents_in_order(results: list[dict[str, object]]) -> list[str]:
    return first_seen(str(r["document_id"]) for r in results)


class RetrievalClient:
    def __init__(self, url: str, key: str, timeout: float = 300.0) -> None:
        self.http = httpx.Client(
            base_url=url.rstrip("/"), headers={"Authorization": f"Bearer {key}"}, timeout=timeout
        )

    def _check(self, r: httpx.Response) -> httpx.Response:
        if r.status_code >= 400:
            msg = UpstreamReply.of("retrieval", r).message
            raise RuntimeError(f"{r.request.method} {r.request.url.path} -> {r.status_code}: {msg}")
        return r

    def ensure_collection(self, name: str, recreate: bool, embedder: str | None = None) -> int:
        """Creates the collection (dropping an old one if ``recreate``), with ``embedder`` as its
        embedding model when given; returns its document count."""
        r = self.http.get(f"/v1/collections/{name}")
        if r.status_code == 200 and recreate:
            self._check(self.http.delete(f"/v1/collections/{name}"))
        elif r.status_code == 200:
            return int(r.json().get("documents") or 0)
        from services.common.embedders import is_embedder_name

        body: dict[str, str] = {"name": name}
        fine_tuned = bool(embedder) and is_embedder_name(embedder or "")
        if embedder and not fine_tuned:
            body["embedding_model"] = embedder
        self._check(self.http.post("/v1/collections", json=body))
        if fine_tuned:
            # a tenant's fine-tuned embedder is reached by switching to it (PATCH), here while
            # the collection is still empty, so the switch is quick and ingestion embeds with it
            job = self._check(self.http.patch(f"/v1/collections/{name}", json={"embedder": embedder})).json()
            self.wait_job(str(job["job_id"]))
        return 0

    def wait_job(self, job_id: str, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            job = self._check(self.http.get(f"/v1/jobs/{job_id}")).json()
            if job.get("status") == "succeeded":
                return
            if job.get("status") == "failed" or time.monotonic() > deadline:
                raise RuntimeError(
                    f"job {job_id} did not succeed: {job.get('status')} {job.get('error') or ''}"
                )
            time.sleep(0.5)  # polled: the job's own events stream would need an SSE client here

    def ingest(self, name: str, docs: list[dict[str, object]]) -> dict[str, object]:
        return dict(
            self._check(self.http.post(f"/v1/collections/{name}/documents", json={"documents": docs})).json()
        )

    def search(self, name: str, query: str, mode: str, top_k: int) -> tuple[list[dict[str, object]], float]:
        t0 = time.perf_counter()
        r = self._check(
            self.http.post(
                f"/v1/collections/{name}/search", json={"query": query, "mode": mode, "top_k": top_k}
            )
        )
        return list(r.json()["results"]), time.perf_counter() - t0

    def close(self) -> None:
        self.http.close()


@dataclass
class ModeScores:
    mode: str
    ndcg10: float
    recall100: float
    mrr10: float
    queries: int
    p50_ms: float
    p95_ms: float


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    idx = min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))
    return s[idx]


def evaluate(
    client: RetrievalClient,
    collection: str,
    data: BeirSet,
    modes: list[str],
    top_k: int = 100,
) -> list[ModeScores]:
    out = []
    for mode in modes:
        nd, rc, mr, lat = [], [], [], []
        for qid, text in data.queries.items():
            results, dt = client.search(collection, text, mode, top_k)
            ranked = documents_in_order(results)
            rel = data.qrels[qid]
            nd.append(ndcg_at(ranked, rel, 10))
            rc.append(recall_at(ranked, rel, 100))
            mr.append(mrr_at(ranked, rel, 10))
            lat.append(dt * 1000)
        n = max(len(nd), 1)
        out.append(
            ModeScores(
                mode,
                sum(nd) / n,
                sum(rc) / n,
                sum(mr) / n,
                len(nd),
                percentile(lat, 0.5),
                percentile(lat, 0.95),
            )
        )
    return out


def retrieval_command(
    beir: Path = typer.Option(
        ..., "--beir", help="BEIR folder: corpus.jsonl, queries.jsonl, qrels/test.tsv."
    ),
    mode: str = typer.Option("all", "--mode", help="dense, sparse, hybrid or all."),
    collection: str = typer.Option(
        "", "--collection", help="Collection to use (default: beir-<folder name>)."
    ),
    reuse: bool = typer.Option(
        False, "--reuse", help="Keep an existing collection of that name instead of re-ingesting."
    ),
    url: str = typer.Option("", "--url", help="Retrieval service URL (default: from settings)."),
    api_key: str = typer.Option("", "--api-key", help="API key (default: $TANDEM_HOME/api-key)."),
    batch: int = typer.Option(128, "--batch", help="Documents per ingestion request."),
    top_k: int = typer.Option(100, "--top-k", help="Results fetched per query (Recall@100 needs 100)."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the figures as JSON here."),
    embedders: list[str] = typer.Option(
        [],
        "--embedder",
        help="Embedder to compare (repeatable): a fine-tuned ft-emb-... name or a model folder; "
        "each gets its own collection. Default: the service's embedding model.",
    ),
    only_queries: Path | None = typer.Option(
        None, "--queries", help="File of query ids (one a line) to evaluate; default: every test query."
    ),
) -> None:
    """Run a BEIR data set through the retrieval service: nDCG@10, Recall@100 and MRR@10 per mode
    (per embedder with --embedder)."""
    from rich.console import Console
    from rich.table import Table

    from services.cli.stack import Layout
    from services.common.config import CommonSettings, load_settings

    console = Console()
    modes = list(MODES) if mode == "all" else [mode]
    if any(m not in MODES for m in modes):
        console.print(f"[red]error:[/] --mode must be one of {', '.join(MODES)} or all, got {mode!r}")
        raise typer.Exit(2)
    try:
        data = load_beir(beir)
        if only_queries is not None:
            data = keep_queries(data, only_queries.read_text().split())
    except (FileNotFoundError, ValueError) as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    common = load_settings(CommonSettings, check_unknown=False)
    key = api_key
    if not key:
        key_file = Layout(common.home_dir).key_file
        if not key_file.exists():
            console.print(f"[red]error:[/] no --api-key and no key file at {key_file}; run `tandem up` first")
            raise typer.Exit(2)
        key = key_file.read_text().strip()
    base_name = collection or f"beir-{beir.resolve().name}"
    client = RetrievalClient(url or common.url_of("retrieval"), key)
    results: list[tuple[str, ModeScores]] = []
    try:
        choices: list[str | None] = [*embedders] or [None]
        for embedder in choices:
            name = collection_name(base_name, embedder)
            have = client.ensure_collection(name, recreate=not reuse, embedder=embedder)
            if not have:
                t0 = time.perf_counter()
                docs = chunks = 0
                for part in corpus_batches(data.corpus, batch):
                    res = client.ingest(name, part)
                    docs += len(part)
                    chunks += int(res.get("chunks_added", 0)) + int(res.get("chunks_unchanged", 0))  # type: ignore[call-overload]
                    console.print(f"  ingested {docs} documents ({chunks} chunks)", end="\r")
                dt = time.perf_counter() - t0
                console.print(
                    f"{name}: ingested {docs} documents, {chunks} chunks in {dt:.1f}s ({chunks / dt:.1f} chunks/s)"
                )
            results += [(embedder or "(default)", s) for s in evaluate(client, name, data, modes, top_k)]
    except (RuntimeError, httpx.HTTPError) as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    finally:
        client.close()
    table = Table(title=f"{beir.name}: {len(data.queries)} queries, collection {base_name}")
    for col in ("embedder", "mode", "nDCG@10", "Recall@100", "MRR@10", "p50 ms", "p95 ms"):
        table.add_column(col, justify="right" if col not in ("mode", "embedder") else "left")
    for embedder, s in results:
        table.add_row(
            embedder,
            s.mode,
            f"{s.ndcg10:.4f}",
            f"{s.recall100:.4f}",
            f"{s.mrr10:.4f}",
            f"{s.p50_ms:.1f}",
            f"{s.p95_ms:.1f}",
        )
    console.print(table)
    if json_out:
        json_out.write_text(json.dumps([{"embedder": e, **s.__dict__} for e, s in results], indent=2))


def collection_name(base: str, embedder: str | None) -> str:
    """``base`` for the service's default model, ``base-<embedder>`` (a safe slug, at most 64
    characters) for another, so each embedder's collection is its own."""
    if not embedder:
        return base[:64]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(embedder).name).strip("-.") or "embedder"
    return f"{base[: 63 - min(len(slug), 40)]}-{slug[:40]}"


def keep_queries(data: BeirSet, ids: list[str]) -> BeirSet:
    wanted = set(ids)
    unknown = sorted(wanted - set(data.queries))
    if unknown:
        raise ValueError(f"--queries names {len(unknown)} query id(s) without qrels, e.g. {unknown[0]!r}")
    return BeirSet(data.corpus, {q: t for q, t in data.queries.items() if q in wanted}, data.qrels)
