"""Benchmark: answers of ``chat-documents`` on invented facts, per prompt/sampling variant.

``python -m benchmarks.answers [--count 50] [--seed 1] [--variants before,after] [--show]``

Starts the CPU stack as separate processes (as ``benchmarks.agent`` does: an embedded Valkey,
then retrieval, inference with the default model, agent), ingests ``--count`` invented facts
of ``--seed`` (services/cli/factset.py) and asks each question through one pipeline per
variant: the variants are pipeline definitions written into the agent's pipelines folder, so
one running stack compares prompts and sampling settings. Each answer is judged as
``tandem eval rag --facts`` judges it (services/cli/eval_rag.py) and a summary table is printed
per variant, with a JSON file per variant under ``--out``.

Variants (``--variants`` names, comma-separated):

- ``before``: the pipeline as it was before issue 20 (its old prompt, greedy, no guard);
- ``after``: the built-in ``chat-documents`` as shipped (prompt, sampling, guard);
- ``after-noguard``: the shipped prompt and sampling without the guard (what the model alone does);
- ``t<T>``, ``p<P>``: suffixes to ``after``/``after-noguard`` such as ``after-noguard-t0.3-p0.9``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from benchmarks.agent.__main__ import free_port, start_service, wait_ready

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
        comps["generate"]["params"] = {"temperature": 0.0}
        comps["guard"]["params"] = {"enabled": False}
        return spec
    gen: dict[str, Any] = dict(comps["generate"].get("params") or {})
    for part in parts[1:]:
        if part == "noguard":
            comps["guard"]["params"] = {"enabled": False}
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=50, help="questions (one invented fact each)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the facts (1: tuning set, 2: held out)")
    ap.add_argument("--variants", default="before,after")
    ap.add_argument("--out", type=Path, default=Path("/tmp/answers-bench"))
    ap.add_argument("--show", action="store_true", help="print each answer")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]

    from services.cli.eval_rag import facts_summary, print_facts_summary, run_facts_eval
    from services.common.auth import KeyStore
    from services.common.redis_conn import sync_redis
    from tests.helpers.models import smollm2_dir
    from tests.helpers.servers import valkey_server

    model_dir = smollm2_dir()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        home = Path(tmp)
        pipelines = home / "pipelines"
        pipelines.mkdir()
        for v in variants:
            (pipelines / f"v-{v}.yaml").write_text(yaml.safe_dump(variant_definition(v)))
        redis_url = stack.enter_context(valkey_server(home / "valkey"))
        key = KeyStore(sync_redis(redis_url)).create("bench")[0]
        ports = {s: free_port() for s in ("retrieval", "inference", "agent")}
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
        env.update(
            TANDEM_HOME=str(home),
            TANDEM_REDIS_URL=redis_url,
            TANDEM_LOG_JSON="false",
            HF_HUB_OFFLINE="1",
            TANDEM_MODEL_ROOTS=f"{home}:{model_dir.parent}",
            TANDEM_INFERENCE_MODEL=str(model_dir),
            TANDEM_AGENT_TOKENIZER=str(model_dir),
            TANDEM_AGENT_PIPELINES_DIR=str(pipelines),
            **{f"TANDEM_{s.upper()}_PORT": str(p) for s, p in ports.items()},
        )
        procs = {}
        for name in ("retrieval", "inference", "agent"):
            procs[name] = start_service(name, ports[name], env, home)
            stack.callback(procs[name].terminate)
        urls = {s: f"http://127.0.0.1:{p}" for s, p in ports.items()}
        for name, proc in procs.items():
            wait_ready(urls[name], proc)
        collection = f"facts-{args.seed}-{args.count}"
        # Warm-up (lazily loaded tokenizer, kernels), on a collection of its own: not timed.
        run_facts_eval(
            1,
            args.seed + 1000,
            agent_url=urls["agent"],
            retrieval_url=urls["retrieval"],
            api_key=key,
            collection="warm-up",
            pipeline=f"v-{variants[0]}".lower(),
        )
        for v in variants:
            outcomes = run_facts_eval(
                args.count,
                args.seed,
                agent_url=urls["agent"],
                retrieval_url=urls["retrieval"],
                api_key=key,
                collection=collection,
                pipeline=f"v-{v}".lower(),
                progress=args.show,
            )
            summary = facts_summary(outcomes)
            print_facts_summary(summary, f"{v}: {args.count} invented facts, seed {args.seed}")
            (args.out / f"{v}-seed{args.seed}.json").write_text(
                json.dumps({"summary": summary, "answers": [o.__dict__ for o in outcomes]}, indent=2)
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
