"""Benchmark: first-token and full-answer latency of ``chat-documents`` over websockets.

``python -m benchmarks.agent [--sessions 1,8] [--questions 2] [--docs 300] [--max-tokens 64]``
``python -m benchmarks.agent --facts 50 [--seed 2] [--lexical]``: the answers instead (below).

Starts the CPU stack as separate processes (an embedded Valkey, then the
retrieval, inference and agent services under uvicorn, as ``tandem up`` does),
ingests a slice of SciFact, and asks SciFact claims:

- baseline: the same pipeline called directly without streaming
  (``POST /v1/pipelines/chat-documents/run``), one request at a time, so the
  user waits for the whole answer;
- websocket sessions: 1 and 8 concurrent ``/v1/ws/chat`` connections, each
  asking ``--questions`` questions in turn; first token and full answer are
  timed at the client.

Prints medians and p95 and the ratios of websocket first-token latency to the
baseline's full-answer latency (what streaming buys the user).

With ``--facts N`` it asks N questions about invented facts (services/cli/factset.py, seed
``--seed``) through ``chat-documents`` as shipped, at the agent's default settings, and reports
per answer what ``tandem eval rag --facts`` does: the expected fact stated, the right document
cited, a valid citation, a repeated sentence, the groundedness share, first token and full answer
times (benchmarks/answers/__main__.py runs it; ``--lexical`` adds the guard on word overlap only,
interleaved, to compare).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import websockets

from benchmarks.agent.stack import REPO, cpu_stack, free_port

__all__ = ["free_port", "main", "pct"]  # free_port: benchmarks.loop takes it from here

SCIFACT = REPO.parent / "shared" / "data" / "scifact"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


async def ws_session(
    url: str, key: str, collection: str, questions: list[str], errors: list[str]
) -> list[tuple[float, float, int]]:
    """(first token s, full answer s, tokens) per answered question, asked in turn on one connection;
    error events are collected in ``errors`` (and the session goes on)."""
    out = []
    async with websockets.connect(
        url, additional_headers={"Authorization": f"Bearer {key}"}, max_size=None
    ) as ws:
        for q in questions:
            start = time.perf_counter()
            frame = {"pipeline": "chat-documents", "collection": collection, "message": q}
            await ws.send(json.dumps(frame))
            first = None
            tokens = 0
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "token":
                    tokens += 1
                    if first is None:
                        first = time.perf_counter() - start
                elif event["type"] == "error":
                    errors.append(str(event.get("message")))
                    break
                elif event["type"] == "done":
                    break
            if event["type"] == "done" and first is not None:
                out.append((first, time.perf_counter() - start, tokens))
    return out


def load_scifact(n_docs: int) -> tuple[list[dict[str, str]], list[str]]:
    qrels: dict[str, list[str]] = {}
    for line in (SCIFACT / "qrels" / "test.tsv").read_text().splitlines()[1:]:
        qid, doc, _ = line.split("\t")
        qrels.setdefault(qid, []).append(doc)
    queries = {}
    for line in (SCIFACT / "queries.jsonl").read_text().splitlines():
        q = json.loads(line)
        queries[q["_id"]] = q["text"]
    wanted_docs = {d for qid in sorted(qrels)[:64] for d in qrels[qid]}
    docs = []
    for line in (SCIFACT / "corpus.jsonl").read_text().splitlines():
        d = json.loads(line)
        if d["_id"] in wanted_docs or len(docs) < n_docs:
            docs.append({"id": d["_id"], "title": d.get("title", ""), "text": d["text"]})
    questions = [queries[q] for q in sorted(qrels)[:64] if q in queries]
    return docs, questions


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--tool-tasks" in argv:  # the agent's tool tasks on the real SmolLM2 (benchmarks/agent/tool_tasks.py)
        from benchmarks.agent.tool_tasks import main as tool_tasks

        return tool_tasks(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--connections",
        "--sessions",
        dest="sessions",
        default="1,8",
        help="concurrent websocket connections to measure",
    )
    ap.add_argument("--questions", type=int, default=2, help="questions per session")
    ap.add_argument("--baseline", type=int, default=4, help="direct non-streaming calls for the baseline")
    ap.add_argument("--docs", type=int, default=100, help="SciFact documents ingested (plus the judged ones)")
    ap.add_argument(
        "--max-tokens", type=int, default=64, help="answer tokens (TANDEM_AGENT_MAX_ANSWER_TOKENS)"
    )
    ap.add_argument("--top-k", type=int, default=3, help="chunks retrieved per question")
    ap.add_argument(
        "--facts",
        type=int,
        default=0,
        help="instead: ask this many invented-fact questions with expected answers through the shipped "
        "chat-documents (agent defaults) and report the per-answer metrics (as benchmarks.answers does)",
    )
    ap.add_argument("--seed", type=int, default=2, help="--facts: seed of the set (1: tuning, 2: held out)")
    ap.add_argument(
        "--lexical", action="store_true", help="--facts: also through the guard on word overlap only"
    )
    ap.add_argument("--out", type=Path, default=Path("/tmp/agent-bench"), help="--facts: JSON per variant")
    args = ap.parse_args(argv)
    if args.facts:
        from benchmarks.answers.__main__ import run

        run(args.facts, args.seed, ["after", *(["after-lexical"] if args.lexical else [])], args.out)
        return 0
    sessions = [int(s) for s in args.sessions.split(",")]

    docs, questions = load_scifact(args.docs)
    with (
        tempfile.TemporaryDirectory() as tmp,
        cpu_stack(
            Path(tmp), TANDEM_AGENT_MAX_ANSWER_TOKENS=str(args.max_tokens), TANDEM_AGENT_TOP_K=str(args.top_k)
        ) as stack,
    ):
        home, key, urls = stack.home, stack.key, stack.urls
        headers = {"Authorization": f"Bearer {key}"}
        t0 = time.perf_counter()
        with httpx.Client(base_url=urls["retrieval"], headers=headers, timeout=600) as rc:
            rc.post("/v1/collections", json={"name": "scifact"}).raise_for_status()
            for i in range(0, len(docs), 100):
                rc.post(
                    "/v1/collections/scifact/documents", json={"documents": docs[i : i + 100]}
                ).raise_for_status()
        print(f"ingested {len(docs)} SciFact documents in {time.perf_counter() - t0:.1f} s")

        # Warm-up: first calls load lazily-initialised pieces (tokenizer, kernels).
        with httpx.Client(base_url=urls["agent"], headers=headers, timeout=600) as ac:
            ac.post(
                "/v1/pipelines/chat-documents/run", json={"query": questions[-1], "collection": "scifact"}
            )
            base_lat = []
            for q in questions[: args.baseline]:
                t = time.perf_counter()
                r = ac.post("/v1/pipelines/chat-documents/run", json={"query": q, "collection": "scifact"})
                r.raise_for_status()
                base_lat.append(time.perf_counter() - t)
        base_med = statistics.median(base_lat)
        rows = [
            (
                "baseline: direct JSON call, sequential",
                1,
                len(base_lat),
                None,
                None,
                base_med,
                pct(base_lat, 95),
            )
        ]
        ws_url = urls["agent"].replace("http://", "ws://") + "/v1/ws/chat"
        for n in sessions:
            qs = [
                [questions[(i * args.questions + j) % len(questions)] for j in range(args.questions)]
                for i in range(n)
            ]

            errors: list[str] = []

            async def run_all(qs: list[list[str]] = qs, errors: list[str] = errors) -> list[Any]:
                return await asyncio.gather(*(ws_session(ws_url, key, "scifact", q, errors) for q in qs))

            results = [r for session in asyncio.run(run_all()) for r in session]
            for err in sorted(set(errors)):
                print(f"  {n} session(s): {errors.count(err)} error event(s): {err[:200]}")
            if errors:
                tail = (home / "inference.log").read_text(errors="replace").splitlines()[-25:]
                print("  inference log tail:\n    " + "\n    ".join(tail))
            if not results:
                continue
            firsts = [r[0] for r in results]
            fulls = [r[1] for r in results]
            rows.append(
                (
                    f"websocket, {n} concurrent session(s)",
                    n,
                    len(results),
                    statistics.median(firsts),
                    pct(firsts, 95),
                    statistics.median(fulls),
                    pct(fulls, 95),
                )
            )
        print()
        print(
            f"chat-documents on the CPU stack (SmolLM2-135M, {args.max_tokens} answer tokens, top_k {args.top_k})"
        )
        hdr = f"{'run':42} {'sess':>4} {'n':>3} {'first p50':>9} {'first p95':>9} {'full p50':>9} {'full p95':>9} {'first/base':>10}"
        print(hdr)
        print("-" * len(hdr))
        for name, n, count, f50, f95, t50, t95 in rows:
            ratio = f"{f50 / base_med:.2f}x" if f50 is not None else "1.00x(full)"
            f50s = f"{f50:.2f}" if f50 is not None else "-"
            f95s = f"{f95:.2f}" if f95 is not None else "-"
            print(f"{name:42} {n:>4} {count:>3} {f50s:>9} {f95s:>9} {t50:>9.2f} {t95:>9.2f} {ratio:>10}")
        print(
            "\nlatencies in seconds, medians (p50) and p95; 'first/base' = websocket first-token p50 over the"
        )
        print("baseline's full-answer p50 (lower is better: the user sees text that much sooner).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
