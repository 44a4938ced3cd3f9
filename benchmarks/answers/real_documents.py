"""``python -m benchmarks.answers --set NAME[,NAME...|all]``: Tandem and the LangChain peer on a
question set over real documents, measured in the same run.

Runs against a stack that is already up (``tandem up``; its ``TANDEM_HOME`` holds the URLs and
the API key, ``--home`` or ``$TANDEM_HOME``). For each set (benchmarks/answers/sets.py): ingests
its documents into collection ``answers-<set>`` through Tandem's file upload (once: a collection
that exists is reused), builds the peer's FAISS index of the same documents with the same
embedder (benchmarks/answers/peer.py), warms both up on a question outside the set, then asks
every question through ``--pipeline`` and the peer in turn (which goes first alternates), so the
machine's load falls on both alike. Each answer is judged as ``tandem eval rag --questions``
judges it (services/cli/eval_questions.py); prints a table per set with Tandem's figures as
ratios to the peer's and writes ``--out/<set>.json`` (summaries and every answer).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.answers.sets import (
    MissingDocuments,
    QuestionSet,
    chosen_sets,
    ensure_collection,
    flat_texts,
    get_set,
    set_pages,
)

PEER = "langchain"
WARM_UP = "What is this documentation about?"


def stack_where(home: Path) -> dict[str, Any]:
    """The running stack's URLs and the API key of tenant ``default``."""
    state = home / "run" / "stack.json"
    try:
        urls = json.loads(state.read_text())["urls"]
        key = (home / "api-key").read_text().strip()
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"no running stack in {home} ({exc}); start one with `tandem up`") from None
    return {"urls": urls, "key": key}


def answer_budget() -> int:
    from services.agent.config import AgentSettings
    from services.common.config import load_settings

    return int(load_settings(AgentSettings, check_unknown=False).max_answer_tokens)


def spread(questions: list[Any]) -> list[Any]:
    """The unanswerable questions spread evenly among the answerable ones (a set file lists
    them last), so the first N questions asked hold both kinds in the set's proportion."""
    yes = [q for q in questions if q.answerable]
    no = [q for q in questions if not q.answerable]
    if not yes or not no:
        return questions
    keyed = [((i + 0.5) / len(yes), 0, q) for i, q in enumerate(yes)]
    keyed += [((i + 0.5) / len(no), 1, q) for i, q in enumerate(no)]
    return [q for _pos, _kind, q in sorted(keyed, key=lambda t: (t[0], t[1]))]


def run_set(
    qs: QuestionSet,
    where: dict[str, Any],
    *,
    pipeline: str = "chat-documents",
    with_peer: bool = True,
    limit: int | None = None,
    progress: bool = False,
    partial: Path | None = None,
) -> dict[str, Any]:
    """``partial``: a file rewritten after every question with the totals so far."""
    from services.cli.eval_questions import judge, load_questions, summary
    from services.cli.eval_rag import ask, progress_line

    urls, key = where["urls"], where["key"]
    headers = {"Authorization": f"Bearer {key}"}
    questions = spread(load_questions(qs.questions))[:limit]
    pages = set_pages(qs)
    documents = flat_texts(pages)
    started = time.perf_counter()
    with httpx.Client(base_url=urls["retrieval"], headers=headers, timeout=1800) as rc:
        made = ensure_collection(rc, qs)
        info = rc.get(f"/v1/collections/{qs.collection}").raise_for_status().json()
    ingest_s = time.perf_counter() - started if made else None
    answerers: dict[str, Any] = {}
    with httpx.Client(base_url=urls["agent"], headers=headers, timeout=600) as ac:
        answerers[pipeline] = lambda text: ask(ac, pipeline, qs.collection, text)
        peer_s = None
        if with_peer:
            from benchmarks.answers.peer import PeerPipeline

            models = httpx.get(f"{urls['inference']}/v1/models", headers=headers, timeout=60).json()["data"]
            model = next(m["id"] for m in models if m.get("kind") != "embedding")
            t0 = time.perf_counter()
            peer = PeerPipeline(
                pages,
                inference_url=urls["inference"],
                api_key=key,
                model=model,
                embedding_model=info["embedding_model"],
                max_tokens=answer_budget(),
            )
            peer_s = time.perf_counter() - t0
            answerers[PEER] = peer.ask
        for ask_one in answerers.values():
            ask_one(WARM_UP)  # not timed: lazy loads, the first prompt's caches
        names = list(answerers)
        outcomes: dict[str, list[Any]] = {n: [] for n in names}
        for i, q in enumerate(questions):
            turn = i % len(names)
            for name in names[turn:] + names[:turn]:
                outcome = judge(q, answerers[name](q.question), documents, cites_sources=True)
                outcomes[name].append(outcome)
                if progress:
                    print(progress_line(i, outcome, f"{name:<14} "), flush=True)
            if partial is not None:  # what a stopped run had asked, judged in full
                partial.write_text(json.dumps({"set": qs.name, "asked": i + 1, "of": len(questions),
                    "summaries": {n: summary(o) for n, o in outcomes.items()},
                    "answers": {n: [o.to_dict() for o in out] for n, out in outcomes.items()}}, default=str))  # fmt: skip
    summaries = {n: summary(o) for n, o in outcomes.items()}
    return {
        "set": qs.name,
        "collection": qs.collection,
        "documents": [p.name for p in qs.documents()],
        "kind": qs.kind,
        "licence": qs.licence,
        "ingest_s": ingest_s,
        "peer_index_s": peer_s,
        "peer_chunks": len(peer.chunks) if with_peer else None,
        "summaries": summaries,
        "answers": {n: [o.to_dict() for o in out] for n, out in outcomes.items()},
    }


def main(
    names: str, *, home: Path | None, out: Path, pipeline: str, peer: bool, limit: int | None, show: bool
) -> int:
    from services.cli.eval_rag import print_questions_summary

    chosen = chosen_sets(names)
    try:
        sets = [get_set(n) for n in chosen]
        for qs in sets:
            qs.documents()
    except (KeyError, MissingDocuments) as exc:
        raise SystemExit(str(exc).strip("'\"")) from None
    where = stack_where(home or Path(os.environ.get("TANDEM_HOME", ".tandem")))
    out.mkdir(parents=True, exist_ok=True)
    for qs in sets:
        partial = out / f"{qs.name}.partial.json"
        result = run_set(
            qs, where, pipeline=pipeline, with_peer=peer, limit=limit, progress=show, partial=partial
        )
        title = f"{qs.name}: {', '.join(result['documents'])} ({qs.kind}), collection {qs.collection}"
        print_questions_summary(result["summaries"], title, ratio_to=PEER if peer else None)
        (out / f"{qs.name}.json").write_text(json.dumps(result, indent=2, default=str))
    return 0
