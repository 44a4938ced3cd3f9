"""Benchmark: answers of ``chat-documents`` on invented facts, per prompt/sampling variant.

``python -m benchmarks.answers [--count 50] [--seed 1] [--variants before,after] [--show]``

``python -m benchmarks.answers --set NAME[,NAME...|all] [--home DIR] [--no-peer] [--limit N]``
scores a question set over real documents on a running stack, against the LangChain RAG
tutorial chain in the same run (benchmarks/answers/real_documents.py, sets.py, README.md).

Starts the CPU stack as separate processes (benchmarks/agent/stack.py: an embedded Valkey,
then retrieval, inference with the default model, agent), ingests ``--count`` invented facts
of ``--seed`` (services/cli/factset.py) and asks each question through one pipeline per
variant: the variants are pipeline definitions written into the agent's pipelines folder, so
one running stack compares prompts and sampling settings. The variants take turns question by
question (``run_facts_evals``), so the machine's load falls on all of them alike. Each answer
is judged as ``tandem eval rag --facts`` judges it (services/cli/eval_rag.py) and a summary
table is printed per variant, with a JSON file per variant under ``--out``.
``python -m benchmarks.agent --facts N`` runs the same for the shipped pipeline.

Variants (``--variants`` names, comma-separated):

- ``before``: the pipeline as it was before issue 20 (its old prompt, greedy, no guard);
- ``after``: the built-in ``chat-documents`` as shipped (the selected sentences answer);
- ``after-generate``: the model writes each answer, the guard falls back to the selected
  sentences (the built-in ``chat-documents-generate``);
- ``after-noguard``: the shipped prompt and sampling, the model's answer without the guard (what
  the model alone does);
- ``after-lexical``: the guard on word overlap only (without the collection's embedder);
- ``t<T>``, ``p<P>``: suffixes to ``after``/``after-noguard`` such as ``after-noguard-t0.3-p0.9``;
- ``rp<R>``, ``fp<F>``, ``pp<P>``: the inference API's ``repetition_penalty``,
  ``frequency_penalty`` and ``presence_penalty`` (``after-noguard-rp1.1``), and ``sp0`` for none
  of the shipped ones (the model's plain greedy output).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.agent.stack import cpu_stack

OLD_INSTRUCTIONS = (
    "Answer the question using only the numbered sources. After each fact, cite its source number in "
    "square brackets, like [1]. If the sources do not answer the question, say you don't know."
)

INSTRUCTION_VARIANTS = {
    "short": (
        "Answer the question in one sentence, using only the numbered sources. Copy names and numbers "
        "exactly as the source writes them, and end the sentence with the source's number in square "
        "brackets, like [1]. If the sources do not answer the question, say you don't know."
    ),
}


def variant_definition(name: str) -> dict[str, Any]:
    from services.agent.pipelines.definition import BUILTIN_DIR

    spec = yaml.safe_load((BUILTIN_DIR / "chat-documents.yaml").read_text())
    spec["name"] = f"v-{name}".lower()
    comps = spec["components"]
    parts = name.split("-")
    if parts[0] == "before":
        comps["prompt"]["params"] = {"instructions": OLD_INSTRUCTIONS}
        comps["select"]["params"] = {"enabled": False}  # no answer step: the model answers
        comps["generate"]["params"] = {"temperature": 0.0}
        comps["guard"]["params"] = {"enabled": False}
        return spec
    gen: dict[str, Any] = dict(comps["generate"].get("params") or {})
    penalties = {"rp": "repetition_penalty", "fp": "frequency_penalty", "pp": "presence_penalty"}
    for part in parts[1:]:
        if part[:2] in penalties and part[2:3].isdigit():
            gen.setdefault("sampling", {})[penalties[part[:2]]] = float(part[2:])
        elif part == "sp0":
            gen["sampling"] = {}
        elif part == "noguard":
            comps["guard"]["params"] = {"enabled": False}
            comps["select"]["params"] = {"extract": False}  # the model writes every answer
        elif part == "generate":
            comps["select"]["params"] = {"extract": False}  # as chat-documents-generate
        elif part == "lexical":
            comps["guard"].setdefault("params", {})["embedder"] = False
        elif part.startswith("t"):
            gen["temperature"] = float(part[1:])
        elif part.startswith("p"):
            gen["top_p"] = float(part[1:])
        elif part.startswith("m"):
            gen["max_tokens"] = int(part[1:])
        elif part == "oldprompt":
            comps["prompt"]["params"] = {"instructions": OLD_INSTRUCTIONS}
        elif part == "ex":
            comps["prompt"].setdefault("params", {})["example"] = True
        elif part == "noex":
            comps["prompt"].setdefault("params", {})["example"] = False
        elif part.startswith("i") and part[1:] in INSTRUCTION_VARIANTS:
            comps["prompt"].setdefault("params", {})["instructions"] = INSTRUCTION_VARIANTS[part[1:]]
    comps["generate"]["params"] = gen
    return spec


def run(
    count: int,
    seed: int,
    variants: list[str],
    out: Path,
    show: bool = False,
    inference_env: dict[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Asks the ``count`` questions of ``seed`` through each variant on a fresh stack (its
    inference service with ``inference_env``'s settings on top); prints and writes
    (``out/<variant>-seed<seed>.json``) each variant's summary; returns the summaries."""
    from services.cli.eval_rag import facts_summary, print_facts_summary, run_facts_eval, run_facts_evals

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pipelines = Path(tmp) / "pipelines"
        pipelines.mkdir()
        for v in variants:
            (pipelines / f"v-{v}.yaml").write_text(yaml.safe_dump(variant_definition(v)))
        with cpu_stack(
            Path(tmp), TANDEM_AGENT_PIPELINES_DIR=str(pipelines), **(inference_env or {})
        ) as stack:
            urls = stack.urls
            where = {"agent_url": urls["agent"], "retrieval_url": urls["retrieval"], "api_key": stack.key}
            # Warm-up (lazily loaded tokenizer, kernels, the embedder), on a collection of its own:
            # not timed.
            for v in variants:
                run_facts_eval(1, seed + 1000, collection="warm-up", pipeline=f"v-{v}".lower(), **where)
            # The inference service loads an embedding model on its first use (seconds): the guard's
            # first call would pay for it, in whichever variant asked first.
            headers = {"Authorization": f"Bearer {stack.key}"}
            with httpx.Client(headers=headers, timeout=600) as client:
                info = client.get(f"{urls['retrieval']}/v1/collections/warm-up").raise_for_status().json()
                body = {"model": info["embedding_model"], "input": ["warm-up"]}
                client.post(f"{urls['inference']}/v1/embeddings", json=body).raise_for_status()
            outcomes = run_facts_evals(
                count,
                seed,
                [f"v-{v}".lower() for v in variants],
                collection=f"facts-{seed}-{count}",
                progress=show,
                **where,
            )
            # The guard judges on word overlap alone when embedding fails: say so, it changes
            # what the variants measure.
            fallbacks = (stack.home / "agent.log").read_text(errors="replace").count("embedding failed")
            print(f"guard: {fallbacks} answer(s) judged on word overlap only because embedding failed")
    summaries = {}
    for v in variants:
        answers = outcomes[f"v-{v}".lower()]
        summaries[v] = summary = facts_summary(answers)
        print_facts_summary(summary, f"{v}: {count} invented facts, seed {seed}")
        (out / f"{v}-seed{seed}.json").write_text(
            json.dumps({"summary": summary, "answers": [o.__dict__ for o in answers]}, indent=2)
        )
    first = variants[0]
    for v in variants[1:]:
        a, b = summaries[v]["total_p50_s"], summaries[first]["total_p50_s"]
        print(f"full answer p50, {v} / {first}: {a:.2f} s / {b:.2f} s = {a / b:.2f}x (same run, interleaved)")
    return summaries


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=50, help="questions (one invented fact each)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the facts (1: tuning set, 2: held out)")
    ap.add_argument("--variants", default="before,after")
    ap.add_argument("--out", type=Path, default=Path("/tmp/answers-bench"))
    ap.add_argument("--show", action="store_true", help="print each answer")
    ap.add_argument(
        "--inference-env",
        action="append",
        default=[],
        metavar="TANDEM_INFERENCE_X=V",
        help="an inference setting for the stack (repeatable), e.g. TANDEM_INFERENCE_PROMPT_DTYPE=float32 to "
        "compare engine settings on the same facts",
    )
    ap.add_argument(
        "--set",
        dest="sets",
        default="",
        help="question sets over real documents (tandem-docs, valgrind-html, libtasn1-pdf, or all), on the "
        "running stack of --home",
    )
    ap.add_argument("--home", type=Path, default=None, help="--set: TANDEM_HOME of the running stack")
    ap.add_argument("--pipeline", default="chat-documents", help="--set: the Tandem pipeline to ask")
    ap.add_argument("--no-peer", action="store_true", help="--set: without the LangChain peer")
    ap.add_argument("--limit", type=int, default=None, help="--set: the first N questions of each set")
    args = ap.parse_args(argv)
    if args.sets:
        from benchmarks.answers import real_documents

        out = args.out if args.out != Path("/tmp/answers-bench") else Path("/tmp/answers-sets")
        return real_documents.main(
            args.sets,
            home=args.home,
            out=out,
            pipeline=args.pipeline,
            peer=not args.no_peer,
            limit=args.limit,
            show=args.show,
        )
    bad = [i for i in args.inference_env if "=" not in i or not i.startswith("TANDEM_INFERENCE_")]
    if bad:
        ap.error(f"--inference-env wants TANDEM_INFERENCE_NAME=VALUE, got {bad[0]!r}")
    env = dict(item.split("=", 1) for item in args.inference_env)
    run(args.count, args.seed, [v for v in args.variants.split(",") if v], args.out, args.show, env)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
