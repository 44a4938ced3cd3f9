"""Retriever tuning with its defaults, through the public HTTP API only (issue 37's targets).

    python -m benchmarks.embedder.tune --set scifact --out tune-scifact.json
    python -m benchmarks.embedder.tune --set docs --out tune-docs.json
    python -m benchmarks.embedder.tune --set scifact --limit-docs 300 --limit-queries 30  # a quick check

What a user gets who presses the button, or scripts the obvious calls: a collection, a file of
labelled pairs uploaded to the trainer (``POST /v1/files``), and one embedder job with the
minimal body

    {"type": "embedder", "base_model": "all-MiniLM-L6-v2", "collection": NAME,
     "dataset": FILE_ID, "apply": true}

and no other option. The job trains with its defaults, measures the collection before and after
on its own held-out share of the pairs, and switches the collection to the new embedder (a
reindex) only when that improved. This benchmark measures, on queries the job never saw (the
held-out half, below), the collection's nDCG@10 by document through
``POST /v1/collections/{name}/search`` before the job and after it: dense and hybrid both times,
sparse once (it does not depend on the embedder). Each query is searched with ``top_k`` 100 and
its ranking collapsed to documents, best first, and scored by ``tandem eval retrieval``'s own
``evaluate`` (``services/cli/eval_retrieval.py``: nDCG@10, Recall@100, MRR@10).

It starts the embedded stack (``tandem up`` in a temporary home, on free ports:
``benchmarks/stack.py``) and stops it at the end (``--keep`` leaves it running), or uses the
running stack of ``--home`` (its ``run/stack.json`` and ``api-key``). The collection
(``--collection``, default ``tune-<set>``) is made anew each run (an old one of that name is
deleted). Times: ``train_s`` is from the job's start to its last training step (the time of
the last point of its metrics), ``job_s`` the job's own start to finish (training, its before/after
measurement, publishing, and the apply step with its reindex), ``total_s`` from the request to
the collection serving its final embedder. The CPU model (``/proc/cpuinfo``) and the date are
recorded with the figures.

Sets:

- ``scifact``: BEIR's SciFact test set (``../shared/data/scifact``: 5,183 documents, 300 queries
  with qrels), ingested as JSON documents (``POST /v1/collections/{name}/documents``, id = the
  corpus ``_id``, title and text, as ``tandem eval retrieval`` ingests it). The queries are split
  as ``benchmarks/embedder`` splits them: a query is held out when
  ``zlib.crc32(query_id) % 2 == 1`` (140 queries); the other 160 (their 173 positive qrels)
  are uploaded as ``pairs`` rows ``{query, positive: title + abstract, document_id}``.
  Licence CC BY-NC 2.0 (allenai/scifact, BEIR): evaluation only, never shipped with the project.
- ``docs``: the real-document question sets of ``benchmarks/answers/sets/`` (tandem-docs,
  valgrind-html, libtasn1-pdf), their 15 documents uploaded as files
  (``POST /v1/collections/{name}/files``, Tandem's own Markdown, HTML and PDF parsers; a
  document's id is its file name) into **one** collection. One collection for the three sets
  because a set alone is too small to rank: libtasn1-pdf is one document (every query would
  score 1.0) and valgrind-html three; together a query is ranked against 15 documents of three
  subjects, two of them (the Tandem and Valgrind documents) with several close neighbours. By
  document this is still an easy ranking (the base model's hybrid nDCG@10 is above 0.95), so
  the set shows whether tuning keeps or loses what works more than how much it gains. Each
  answerable question is a labelled query whose relevant document is that of its ``source``; a
  question is held out when ``zlib.crc32(question_id) % 2 == 1``. The others are uploaded as
  ``pairs`` rows whose positive is the passage from the question's ``section`` (on its
  ``page`` for the PDF; the job maps a labelled positive to its document's chunk nearest the
  query in any case) and whose ``document_id`` is that file. Licences: the project's own
  documentation; Valgrind's manual GNU GPL v2 or later; the libtasn1 manual GNU FDL 1.3 or
  later. The outside documents come from Debian packages: ``apt-get install valgrind
  libtasn1-doc``.

``--limit-docs N --limit-queries M`` make a quick, not comparable check (scifact): at most M
queries of each half, and N documents (those the kept queries are about first).
``--no-apply`` sends the minimal body without ``apply`` (a job that trains and evaluates but
switches nothing: a check of the rest of the benchmark against a trainer without it).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.answers.real_documents import stack_where
from benchmarks.answers.sets import SETS, MissingDocuments, Page, QuestionSet, set_pages
from benchmarks.embedder.__main__ import SCIFACT, held_out
from services.cli.eval_retrieval import (
    MODES,
    BeirSet,
    ModeScores,
    RetrievalClient,
    corpus_batches,
    evaluate,
    load_beir,
)
from services.common import platforms

BASE_MODEL = "all-MiniLM-L6-v2"
TOP_K = 100  # results per query, collapsed to documents: nDCG@10 by document, Recall@100
AFTER_MODES = ["dense", "hybrid"]  # sparse (BM25) does not change with the embedder
TERMINAL = ("succeeded", "failed", "cancelled")
PASSAGE_CHARS = 1500
BATCH = 64  # documents per ingestion request


@dataclass
class Labelled:
    """A set ingested into its collection: the training pairs and the held-out queries."""

    documents: int
    chunks: int
    ingest_s: float
    train_rows: list[dict[str, Any]]
    train_queries: int
    held: BeirSet
    licence: str
    notes: dict[str, Any] = field(default_factory=dict)


# The measurement's own searches (hundreds a minute, before and after) are the harness's, not a
# tenant's abuse: the stack it starts has no per-tenant request rate (the job's own reads of the
# collection, a page of documents a request, stay far below the default one anyway).
UNLIMITED = {f"TANDEM_{svc}_TENANT_REQUESTS_PER_MINUTE": "0" for svc in ("RETRIEVAL", "TRAINER", "AGENT")}


# -- scifact ---------------------------------------------------------------------------------------


def scifact_documents(root: Path) -> list[dict[str, Any]]:
    """The corpus rows that ``tandem eval retrieval`` ingests (a blank text is skipped)."""
    rows = [json.loads(line) for line in (root / "corpus.jsonl").open() if line.strip()]
    return [d for d in rows if str(d.get("text", "")).strip()]


def scifact(
    client: RetrievalClient, name: str, root: Path, limit_docs: int | None, limit_queries: int | None
) -> Labelled:
    from services.trainer.data.pairs import doc_text

    data = load_beir(root)
    train_q = [q for q in data.queries if not held_out(q)][:limit_queries]
    held_q = [q for q in data.queries if held_out(q)][:limit_queries]
    docs = scifact_documents(root)
    if limit_docs:  # the kept queries' documents first, then the corpus in its order
        wanted = {d: None for q in held_q + train_q for d, g in data.qrels[q].items() if g > 0}
        docs.sort(key=lambda d: str(d["_id"]) not in wanted)  # stable: corpus order otherwise
        docs = docs[:limit_docs]
    by_id = {str(d["_id"]): d for d in docs}
    qrels = {q: {d: g for d, g in data.qrels[q].items() if d in by_id} for q in train_q + held_q}
    train_q = [q for q in train_q if any(g > 0 for g in qrels[q].values())]
    held_q = [q for q in held_q if any(g > 0 for g in qrels[q].values())]

    t0 = time.perf_counter()
    chunks = 0
    done = 0
    kept = (d for batch in corpus_batches(data.corpus, BATCH) for d in batch if str(d["id"]) in by_id)
    while batch := list(itertools.islice(kept, BATCH)):
        chunks += ingest(client, name, batch)
        done += len(batch)
        print(f"  ingested {done}/{len(by_id)} documents ({chunks} chunks)", end="\r", flush=True)
    ingest_s = time.perf_counter() - t0
    print(f"\n{name}: {done} documents, {chunks} chunks in {ingest_s:.0f}s", flush=True)

    rows = [
        {
            "query": data.queries[q],
            "positive": doc_text(by_id[d].get("title") or "", by_id[d]["text"]),
            "document_id": d,
        }
        for q in train_q
        for d, g in qrels[q].items()
        if g > 0
    ]
    held = BeirSet(data.corpus, {q: data.queries[q] for q in held_q}, {q: qrels[q] for q in held_q})
    return Labelled(
        documents=done,
        chunks=chunks,
        ingest_s=ingest_s,
        train_rows=rows,
        train_queries=len(train_q),
        held=held,
        licence="SciFact: CC BY-NC 2.0 (allenai/scifact, BEIR), evaluation only",
    )


def ingest(client: RetrievalClient, name: str, batch: list[dict[str, object]]) -> int:
    """Ingests ``batch`` (waiting for the job when the service made it one); its chunk count."""
    res = client.ingest(name, batch)
    if res.get("job_id"):
        client.wait_job(str(res["job_id"]), timeout=3600)
        return 0  # counted from the collection afterwards
    return int(res.get("chunks_added", 0)) + int(res.get("chunks_unchanged", 0))  # type: ignore[call-overload]


# -- the real-document sets ------------------------------------------------------------------------


def passage(question: Any, pages: list[Page]) -> str:
    """The text of the question's section in its source (on its page for a PDF), or the start of
    the source when the section title is not found in it."""
    source = Path(str(question.source)).name
    mine = [p for p in pages if p.source == source and (question.page is None or p.page == question.page)]
    text = re.sub(r"\s+", " ", " ".join(p.text for p in mine)).strip()
    at = text.lower().find((question.section or "").lower()) if question.section else -1
    return text[max(at, 0) : max(at, 0) + PASSAGE_CHARS]


def docs_sets(client: RetrievalClient, name: str, limit_queries: int | None) -> Labelled:
    from services.cli.bootstrap_docs import _wait_for_job
    from services.cli.eval_questions import load_questions

    sets: list[QuestionSet] = list(SETS.values())
    try:
        for qs in sets:
            qs.documents()
    except MissingDocuments as exc:
        raise SystemExit(str(exc)) from None
    t0 = time.perf_counter()
    for qs in sets:  # one upload per set, as benchmarks/answers/sets.py's ensure_collection makes
        files = [("file", (p.name, p.read_bytes())) for p in qs.documents()]
        resp = client.http.post(
            f"/v1/collections/{name}/files",
            files=files,
            data={"metadata": json.dumps({"set": qs.name})},
            timeout=1800,
        )
        resp.raise_for_status()
        if job := resp.json().get("job_id"):
            _wait_for_job(client.http, str(job), 1800)
        print(f"{name}: {qs.name} ingested ({len(files)} files)", flush=True)
    ingest_s = time.perf_counter() - t0
    ids = document_ids(client, name)

    rows: list[dict[str, Any]] = []
    queries: dict[str, str] = {}
    qrels: dict[str, dict[str, int]] = {}
    train_queries = 0
    kept: dict[str, list[int]] = {}
    for qs in sets:
        pages = set_pages(qs)
        questions = [q for q in load_questions(qs.questions) if q.answerable and q.source]
        train = [q for q in questions if not held_out(q.id)][:limit_queries]
        held = [q for q in questions if held_out(q.id)][:limit_queries]
        for q in train + held:
            if Path(str(q.source)).name not in ids:
                raise SystemExit(f"{qs.name} {q.id}: source {q.source!r} is no document of {name}: {ids}")
        rows += [
            {"query": q.question, "positive": passage(q, pages), "document_id": Path(str(q.source)).name}
            for q in train
        ]
        train_queries += len(train)
        for q in held:
            queries[q.id] = q.question
            qrels[q.id] = {Path(str(q.source)).name: 1}
        kept[qs.name] = [len(train), len(held)]
    return Labelled(
        documents=len(ids),
        chunks=0,
        ingest_s=ingest_s,
        train_rows=rows,
        train_queries=train_queries,
        held=BeirSet(Path(), queries, qrels),
        licence="; ".join(f"{qs.name}: {qs.licence}" for qs in sets),
        notes={"training and held-out questions per set": kept, "document_ids": ids},
    )


def document_ids(client: RetrievalClient, name: str) -> list[str]:
    out: list[str] = []
    offset: int | None = 0
    while offset is not None:
        page = client.http.get(
            f"/v1/collections/{name}/documents", params={"limit": 1000, "offset": offset}
        ).raise_for_status()
        body = page.json()
        out += [str(d["id"]) for d in body["documents"]]
        offset = body.get("next_offset")
    return out


# -- the job -----------------------------------------------------------------------------------------


def upload_pairs(trainer: httpx.Client, rows: list[dict[str, Any]], filename: str) -> dict[str, Any]:
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    resp = trainer.post("/v1/files", files={"file": (filename, data, "application/jsonl")})
    if resp.status_code >= 400:
        raise SystemExit(f"POST /v1/files -> {resp.status_code}: {resp.text}")
    return dict(resp.json())


def run_job(
    trainer: httpx.Client, retrieval: RetrievalClient, body: dict[str, Any], timeout: float, poll: float
) -> dict[str, Any]:
    """Starts the job and polls it (printing its progress and log lines), then the reindex its
    apply step started, until the collection serves its final embedder: the final job object,
    its logs, the reindex job and the times. ``train_s`` is from the job's start to its last
    training step (the time of the last point of ``GET /v1/jobs/{id}/metrics``)."""
    t_submit = time.perf_counter()
    resp = trainer.post("/v1/jobs", json=body)
    if resp.status_code >= 400:
        raise SystemExit(f"POST /v1/jobs {json.dumps(body)} -> {resp.status_code}: {resp.text}")
    job = resp.json()
    jid = job["id"]
    print(f"job {jid}: {job['status']}", flush=True)
    last: tuple[Any, ...] = ()
    logs: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while True:
        state = (job["status"], job["progress"]["step"], job["progress"]["total"], job.get("apply"))
        if state != last:
            print(
                f"  {time.perf_counter() - t_submit:6.0f}s {state[0]} step {state[1]}/{state[2]}"
                + (f" apply {json.dumps(state[3])}" if state[3] else ""),
                flush=True,
            )
            last = state
        fresh = trainer.get(f"/v1/jobs/{jid}/logs").raise_for_status().json()["data"][len(logs) :]
        for line in fresh:
            print(f"    log: {line.get('message')}", flush=True)
        logs += fresh
        if job["status"] in TERMINAL:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"job {jid} still {job['status']} after {timeout:.0f}s")
        time.sleep(poll)
        job = trainer.get(f"/v1/jobs/{jid}").raise_for_status().json()
    t_done = time.perf_counter()
    reindex: dict[str, Any] | None = None
    reindex_id = (job.get("apply") or {}).get("reindex_job")
    if reindex_id:  # the job waits for it (the contract); whatever is left is waited for here
        while True:
            reindex = retrieval.http.get(f"/v1/jobs/{reindex_id}").raise_for_status().json()
            if reindex["status"] in TERMINAL or time.monotonic() > deadline:
                break
            time.sleep(poll)
    t_end = time.perf_counter()
    points = trainer.get(f"/v1/jobs/{jid}/metrics").raise_for_status().json()["data"]
    started, finished = job.get("started_at"), job.get("finished_at")
    stepped = [float(p["time"]) for p in points if "time" in p]
    return {
        "job": job,
        "logs": logs,
        "reindex": reindex,
        "train_s": max(stepped) - started if started and stepped else None,
        "job_s": finished - started if started and finished else None,
        "queued_s": started - job["created_at"] if started else None,
        "job_done_s": t_done - t_submit,
        "total_s": t_end - t_submit,
    }


# -- the run -------------------------------------------------------------------------------------


@contextmanager
def stack(home: Path | None, keep: bool) -> Iterator[dict[str, Any]]:
    if home is not None:
        yield stack_where(home)
        return
    from benchmarks.stack import embedded_stack

    try:
        with embedded_stack("tandem-tune-", UNLIMITED, keep=keep) as s:
            yield stack_where(s.home)
    except RuntimeError as exc:  # tandem up failed: its output says why
        raise SystemExit(str(exc)) from None


def scores(rows: list[ModeScores]) -> dict[str, dict[str, float]]:
    return {
        s.mode: {
            "ndcg10": s.ndcg10,
            "recall100": s.recall100,
            "mrr10": s.mrr10,
            "queries": s.queries,
            "p50_ms": s.p50_ms,
        }
        for s in rows
    }


def fmt(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(r: dict[str, Any]) -> str:
    b, a = r["before"], r["after"]
    cells = []
    for mode in MODES:
        base = b[mode]["ndcg10"]
        after = a.get(mode, b[mode])["ndcg10"]  # sparse: measured once
        gain = f"{after - base:+.4f}" if mode in a else "(once)"
        cells.append(f"{base:.4f} | {after:.4f} | {gain}")
    job = r["job"]
    apply = job["job"].get("apply") or {}
    yard = f"{fmt(apply.get('before'))} -> {fmt(apply.get('after'))}"
    lines = [
        f"\n{r['set']}: {r['documents']} documents, {r['train_pairs']} training pairs "
        f"({r['train_queries']} queries), {r['held_out_queries']} held-out queries; collection "
        f"{r['collection']}; {r['cpu']}, {r['cpus']} CPUs; {r['date']}",
        "",
        "| set | dense base | dense after | gain | sparse base | sparse after | gain | hybrid base "
        "| hybrid after | gain | train s | total s | applied | job's before -> after | yardstick (held out) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
        f"| {r['set']} | {' | '.join(cells)} | {fmt(job['train_s'], 0)} | {fmt(job['total_s'], 0)} | "
        f"{apply.get('applied', job['job'].get('applied'))} | {yard} ({apply.get('mode', '-')}) | "
        f"{apply.get('yardstick', '-')} ({apply.get('held_out', '-')}) |",
        "",
        f"job {job['job']['id']}: {job['job']['status']}"
        + (f" ({job['job']['error']})" if job["job"].get("error") else "")
        + f"; model {job['job'].get('fine_tuned_model')}; collection embedder "
        f"{r['embedder_before']} -> {r['embedder_after']}; reason: {apply.get('reason', '-')}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", required=True, choices=["scifact", "docs"], dest="which")
    ap.add_argument("--out", type=Path, help="write every figure, the job and its request here (JSON)")
    ap.add_argument(
        "--home", type=Path, help="use the running stack of this TANDEM_HOME instead of starting one"
    )
    ap.add_argument("--keep", action="store_true", help="leave the stack this starts running")
    ap.add_argument("--collection", default="", help="the collection made anew (default: tune-<set>)")
    ap.add_argument("--beir", type=Path, default=SCIFACT, help="the SciFact BEIR folder")
    ap.add_argument(
        "--limit-docs", type=int, default=None, help="scifact: at most N documents (a quick check)"
    )
    ap.add_argument("--limit-queries", type=int, default=None, help="at most N queries of each half")
    ap.add_argument("--no-apply", action="store_true", help="leave 'apply' out of the job's body")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds to wait for the job")
    ap.add_argument("--poll", type=float, default=2.0, help="seconds between polls of the job")
    args = ap.parse_args(argv)
    name = args.collection or f"tune-{args.which}"
    started = datetime.datetime.now(datetime.UTC)
    t0 = time.perf_counter()

    with stack(args.home, args.keep) as where:
        urls, key = where["urls"], where["key"]
        headers = {"Authorization": f"Bearer {key}"}
        retrieval = RetrievalClient(urls["retrieval"], key, timeout=1800)
        trainer = httpx.Client(base_url=urls["trainer"], headers=headers, timeout=600)
        try:
            retrieval.ensure_collection(name, recreate=True)
            if args.which == "scifact":
                labelled = scifact(retrieval, name, args.beir, args.limit_docs, args.limit_queries)
            else:
                labelled = docs_sets(retrieval, name, args.limit_queries)
            info = retrieval.http.get(f"/v1/collections/{name}").raise_for_status().json()
            held = labelled.held
            print(
                f"{name}: {info.get('documents')} documents, {info.get('chunks')} chunks, embedder "
                f"{info.get('embedder') or info['embedding_model']}; {len(labelled.train_rows)} training "
                f"pairs ({labelled.train_queries} queries), {len(held.queries)} held-out queries",
                flush=True,
            )
            t = time.perf_counter()
            before = scores(evaluate(retrieval, name, held, list(MODES), TOP_K))
            print(f"before ({time.perf_counter() - t:.0f}s): {json.dumps(before)}", flush=True)

            upload = upload_pairs(trainer, labelled.train_rows, f"{name}-pairs.jsonl")
            print(f"uploaded {upload['id']}: {upload['rows']} rows, format {upload['format']}", flush=True)
            body: dict[str, Any] = {
                "type": "embedder",
                "base_model": BASE_MODEL,
                "collection": name,
                "dataset": upload["id"],
            }
            if not args.no_apply:
                body["apply"] = True
            job = run_job(trainer, retrieval, body, args.timeout, args.poll)

            info_after = retrieval.http.get(f"/v1/collections/{name}").raise_for_status().json()
            t = time.perf_counter()
            after = scores(evaluate(retrieval, name, held, AFTER_MODES, TOP_K))
            print(f"after ({time.perf_counter() - t:.0f}s): {json.dumps(after)}", flush=True)
        finally:
            retrieval.close()
            trainer.close()

    report: dict[str, Any] = {
        "set": args.which,
        "command": "python -m benchmarks.embedder.tune " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": started.isoformat(timespec="seconds"),
        "cpu": platforms.cpu_model(),
        "cpus": os.cpu_count(),
        "collection": name,
        "documents": info.get("documents") or labelled.documents,
        "chunks": info.get("chunks") or labelled.chunks,
        "ingest_s": labelled.ingest_s,
        "train_pairs": len(labelled.train_rows),
        "train_queries": labelled.train_queries,
        "held_out_queries": len(held.queries),
        "held_out_ids": list(held.queries),
        "licence": labelled.licence,
        "limits": {"documents": args.limit_docs, "queries": args.limit_queries},
        "request": body,
        "dataset": upload,
        "embedder_before": info.get("embedder") or info["embedding_model"],
        "embedder_after": info_after.get("embedder") or info_after["embedding_model"],
        "before": before,
        "after": after,
        "gain": {m: after[m]["ndcg10"] - before[m]["ndcg10"] for m in AFTER_MODES},
        "job": job,
        "apply": job["job"].get("apply"),
        "applied": job["job"].get("applied"),
        "wall_s": time.perf_counter() - t0,
        **labelled.notes,
    }
    print(table(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str))
        print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
