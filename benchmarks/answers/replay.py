"""``python -m benchmarks.answers.replay [--set all] [--home DIR] [--top-k N] [--no-rerank]``: the
answer step of ``chat-documents`` on the question sets, replayed in process over a running stack.

For each question of the sets (benchmarks/answers/sets.py; their collections must exist: run
``python -m benchmarks.answers --set NAME`` once), the shipped ``chat-documents`` pipeline's steps
up to its answer step (rewrite, retrieve, the overlap reranker, the relevance filter, the
prompt's sources, then services/agent/pipelines/selection.py with the collection's embedder) run
here against the stack's retrieval and inference services: what ``chat-documents`` answers,
judged as ``tandem eval rag --questions`` judges it, in seconds rather than minutes.
``--top-k`` and ``--no-rerank`` compare retrieval settings on the same stack; latency is not
measured here (``python -m benchmarks.answers --set`` does, end to end).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.answers.real_documents import stack_where
from benchmarks.answers.sets import chosen_sets, get_set


@dataclass
class Judged:
    set: str
    id: str
    answerable: bool
    kind: str  # "extractive" | "not_found"
    stated: bool
    right_source: bool
    answer: str


def stack_context(where: dict[str, Any]) -> Any:
    """A pipeline run's context against the stack's retrieval and inference services."""
    from services.agent.clients import InferenceClient, RetrievalClient
    from services.agent.config import AgentSettings
    from services.agent.pipelines.state import RunContext
    from services.agent.tokens import load_counter
    from services.common.config import load_settings

    settings = load_settings(AgentSettings, check_unknown=False)
    urls, key = where["urls"], where["key"]
    return RunContext(
        settings=settings,
        retrieval=RetrievalClient(urls["retrieval"], key),
        inference=InferenceClient(urls["inference"], key),
        counter=load_counter(settings.tokenizer),
        model="",
    )


def chat_steps(*, through_answer: bool, rerank: bool = True) -> list[Any]:
    """The shipped ``chat-documents`` steps up to its answer step (included or not)."""
    from services.agent.pipelines.definition import BUILTIN_DIR, load_definition_file

    pipeline = load_definition_file(BUILTIN_DIR / "chat-documents.yaml")
    kinds = [pipeline.spec.components[n].type for n in pipeline.order]
    upto = kinds.index("answer_selector") + (1 if through_answer else 0)
    return [
        pipeline.nodes[n]
        for n, kind in zip(pipeline.order[:upto], kinds[:upto], strict=True)
        if rerank or kind != "overlap_reranker"
    ]


async def replay_set(name: str, where: dict[str, Any], *, top_k: int | None, rerank: bool) -> list[Judged]:
    from services.agent.pipelines.state import RunState
    from services.cli.eval_questions import load_questions, states

    qs = get_set(name)
    ctx = stack_context(where)
    # chat-documents as shipped, up to and including its answer step (what comes after it is
    # the model's, which an answered question never reaches)
    steps = chat_steps(through_answer=True, rerank=rerank)
    out: list[Judged] = []
    for q in load_questions(qs.questions):
        state = RunState(question=q.question, collection=qs.collection)
        if top_k is not None:
            state.options["top_k"] = top_k  # a per-request top_k, as a caller sends it
        for step in steps:
            async for _ in step.run(state, ctx):
                pass
        # no source left at all: the generator would say "I don't know" (not found) without a call
        kind = state.answer_kind if state.answer else "not_found"
        cited = [c for c in state.citations if c.kind == "extractive"]
        right = any(q.cited_by(c.model_dump()) for c in cited)
        stated = q.answerable and kind == "extractive" and states(state.answer, q)
        out.append(Judged(name, q.id, q.answerable, kind, stated, right, state.answer))
    return out


def totals(judged: list[Judged]) -> dict[str, Any]:
    yes = [j for j in judged if j.answerable]
    no = [j for j in judged if not j.answerable]
    return {
        "answerable": len(yes),
        "stated": sum(j.stated for j in yes),
        "right_source": sum(j.right_source for j in yes),
        "false_not_found": sum(j.kind == "not_found" for j in yes),
        "unanswerable": len(no),
        "not_found": sum(j.kind == "not_found" for j in no),
    }


def line(label: str, t: dict[str, Any]) -> str:
    return (
        f"{label:<16} stated {t['stated']}/{t['answerable']}  right source {t['right_source']}/{t['answerable']}"
        f"  not found {t['not_found']}/{t['unanswerable']}  false not found {t['false_not_found']}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="all", help="set names, comma-separated, or all")
    ap.add_argument("--home", type=Path, default=None, help="TANDEM_HOME of the running stack")
    ap.add_argument("--top-k", type=int, default=None, help="chunks retrieved (default: the agent's)")
    ap.add_argument("--no-rerank", action="store_true", help="without the overlap reranker")
    ap.add_argument("--json", type=Path, default=None, help="write every answer here")
    args = ap.parse_args()
    names = chosen_sets(args.set)
    where = stack_where(args.home or Path(os.environ.get("TANDEM_HOME", ".tandem")))
    judged: list[Judged] = []
    for name in names:
        got = asyncio.run(replay_set(name, where, top_k=args.top_k, rerank=not args.no_rerank))
        print(line(name, totals(got)), flush=True)
        judged += got
    print(line("all", totals(judged)))
    if args.json is not None:
        args.json.write_text(json.dumps([j.__dict__ for j in judged], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
