"""A question set on a collection of a running stack: retrieval nDCG@10 by page, and the answers.

**nDCG@10 by page.** For an answerable question that names its ``page``, the relevant chunks are
the chunks of the question's source document (or of an ``also_in`` one) whose ``pages`` hold
that page, each of gain 1; the ranking is the first 10 results of the collection's search
(``POST /v1/collections/{name}/search``, hybrid, the service's defaults, no reranker), scored
with services/common/ranking.py's ``ndcg_at`` against the ideal ranking of that page's chunks.
A page no chunk is on (a page the parser got nothing from) scores 0. The chunks and their pages
are read back from the collection (``GET .../documents?full=true``), so a scanned PDF, cut into
other chunks than its original, is scored against its own.

**Answers**: every question through ``chat-documents`` (``services/cli/eval_rag.ask``), judged
as ``tandem eval rag --questions`` judges it (stated, right source, right page or section,
"not found"), unanswerable ones spread among the others (benchmarks/answers/real_documents.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from services.common.ranking import ndcg_at

K = 10


@dataclass(frozen=True)
class Chunk:
    id: str
    document: dict[str, Any]  # document_id, title, metadata: what a source is matched against
    pages: tuple[int, ...]


def upload(client: httpx.Client, collection: str, paths: list[Path], timeout: float = 3600) -> dict[str, Any]:
    """Creates ``collection`` and uploads ``paths`` through ``/files`` (the ingestion worker's
    sandboxed parsers), waiting for the job. Returns what happened: ``status`` (``succeeded``,
    ``failed``, or ``exists`` for a collection made before), ``error``, ``file_errors``,
    ``result`` and the seconds it took."""
    if client.get(f"/v1/collections/{collection}").status_code == 200:
        return {"status": "exists"}
    client.post("/v1/collections", json={"name": collection}).raise_for_status()
    started = time.perf_counter()
    files = [("file", (p.name, p.read_bytes())) for p in paths]
    resp = client.post(f"/v1/collections/{collection}/files", files=files, timeout=timeout)
    if resp.status_code >= 400:
        return {"status": "refused", "error": resp.text[:500], "seconds": time.perf_counter() - started}
    job_id = resp.json().get("job_id")
    job: dict[str, Any] = {"status": "succeeded"}
    deadline = time.monotonic() + timeout
    while job_id:
        job = client.get(f"/v1/jobs/{job_id}").raise_for_status().json()
        if job["status"] not in ("queued", "running"):
            break
        if time.monotonic() > deadline:
            job = {**job, "status": "timed out"}
            break
        time.sleep(0.5)
    return {
        "status": job["status"],
        "error": job.get("error"),
        "file_errors": job.get("file_errors") or [],
        "result": job.get("result"),
        "seconds": time.perf_counter() - started,
    }


def collection_chunks(client: httpx.Client, collection: str) -> list[Chunk]:
    out: list[Chunk] = []
    offset: int | None = 0
    while offset is not None:
        page = (
            client.get(
                f"/v1/collections/{collection}/documents",
                params={"full": "true", "limit": 100, "offset": offset},
            )
            .raise_for_status()
            .json()
        )
        for doc in page["documents"]:
            who = {"document_id": doc["id"], "title": doc.get("title"), "metadata": doc.get("metadata") or {}}
            for c in doc.get("chunk_list") or []:
                out.append(Chunk(c["chunk_id"], who, tuple(c.get("pages") or ())))
        offset = page.get("next_offset")
    return out


def relevant_chunks(q: Any, chunks: list[Chunk]) -> dict[str, int]:
    """The chunks of ``q``'s source document(s) on ``q.page``, each of gain 1."""
    from services.agent.evals.judge import source_matches

    return {
        c.id: 1 for c in chunks if q.page in c.pages and any(source_matches(s, c.document) for s in q.sources)
    }


def retrieval_ndcg(client: httpx.Client, collection: str, questions: list[Any]) -> dict[str, Any]:
    """nDCG@10 by page over the answerable questions that name a page (see the module's doc)."""
    chunks = collection_chunks(client, collection)
    per: dict[str, float] = {}
    hits: dict[str, int] = {}
    for q in questions:
        if not q.answerable or q.page is None:
            continue
        rel = relevant_chunks(q, chunks)
        resp = client.post(f"/v1/collections/{collection}/search", json={"query": q.question, "top_k": K})
        ranked = [r["chunk_id"] for r in resp.raise_for_status().json()["results"]]
        per[q.id] = ndcg_at(ranked, rel, K) if rel else 0.0
        hits[q.id] = sum(1 for c in ranked if c in rel)
    scored = list(per.values())
    return {
        "ndcg@10": sum(scored) / len(scored) if scored else None,
        "questions": len(scored),
        "pages_without_chunks": sorted(
            {q.page for q in questions if q.answerable and q.page} - {p for c in chunks for p in c.pages}
        ),
        "chunks": len(chunks),
        "per_question": per,
        "relevant_in_top10": hits,
    }


def answers(
    where: dict[str, Any], collection: str, questions: list[Any], documents: list[str], *, show: bool = False
) -> dict[str, Any]:
    """Every question through ``chat-documents``, judged; the summary and every answer."""
    from benchmarks.answers.real_documents import WARM_UP, spread
    from services.cli.eval_questions import judge, summary
    from services.cli.eval_rag import ask, progress_line

    headers = {"Authorization": f"Bearer {where['key']}"}
    outcomes = []
    with httpx.Client(base_url=where["urls"]["agent"], headers=headers, timeout=600) as ac:
        ask(ac, "chat-documents", collection, WARM_UP)  # not judged: lazy loads, first caches
        for i, q in enumerate(spread(questions)):
            outcome = judge(
                q, ask(ac, "chat-documents", collection, q.question), documents, cites_sources=True
            )
            outcomes.append(outcome)
            if show:
                print(progress_line(i, outcome, f"{collection:<28} "), flush=True)
    return {"summary": summary(outcomes), "answers": [o.to_dict() for o in outcomes]}


def measure(
    where: dict[str, Any],
    collection: str,
    paths: list[Path],
    questions_file: Path,
    documents: list[str],
    *,
    show: bool = False,
) -> dict[str, Any]:
    """Ingests ``paths`` into ``collection`` (once) and measures the set of ``questions_file``
    on it. ``documents``: the texts groundedness is judged against (the original's)."""
    from services.cli.eval_questions import load_questions

    questions = load_questions(questions_file)
    headers = {"Authorization": f"Bearer {where['key']}"}
    with httpx.Client(base_url=where["urls"]["retrieval"], headers=headers, timeout=600) as rc:
        ingest = upload(rc, collection, paths)
        made = rc.get(f"/v1/collections/{collection}").status_code == 200
        info = rc.get(f"/v1/collections/{collection}").json() if made else {}
        ndcg = retrieval_ndcg(rc, collection, questions) if made else None
    out: dict[str, Any] = {
        "collection": collection,
        "documents": [p.name for p in paths],
        "questions_file": str(questions_file),
        "ingest": ingest,
        "collection_info": {k: info.get(k) for k in ("documents", "chunks", "embedding_model")},
        "retrieval": ndcg,
    }
    out.update(answers(where, collection, questions, documents, show=show))
    return out


def write(out_dir: Path, name: str, result: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    return path
