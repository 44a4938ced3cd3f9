"""Agent tool tasks with the real SmolLM2-135M: the 4 calculator tasks and a set of 20 tool tasks.

``python -m benchmarks.agent --tool-tasks [--mode react|openai|both] [--only-calc] [--max-steps 4]``

Starts, in this process over real HTTP, an embedded Valkey, the retrieval service (with a small
collection of facts) and the inference service on SmolLM2-135M-Instruct (the default model), then runs
the agent loop (``AgentRunner``, as the agent service runs it) on each task. A task is solved when the
expected number is stated once in the final answer with no number other than the question's
(``solved``), or for a text answer, the expected word appears in it as a whole word.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from services.agent.config import AgentSettings

# The four calculator tasks the agent's real-model test uses (tests/agent/test_integration.py).
CALC_TASKS = [
    ("What is 17 times 23?", "391"),
    ("What is 1234 plus 4321?", "5555"),
    ("What is 144 divided by 12?", "12"),
    ("What is 25 times 25?", "625"),
]

# The collection the search tasks ask (six short encyclopedia-style documents).
DOCS = json.loads((Path(__file__).with_name("tool_docs.json")).read_text())

# 20 tool tasks: 12 calculator, 8 collection search (scored by ``solved``).
TOOL_TASKS = [
    ("What is 12 times 12?", "144"),
    ("What is 345 plus 655?", "1000"),
    ("What is 1000 minus 1?", "999"),
    ("What is 81 divided by 9?", "9"),
    ("What is 7 times 8?", "56"),
    ("What is 2 to the power of 10?", "1024"),
    ("What is 250 plus 250?", "500"),
    ("What is 99 minus 45?", "54"),
    ("What is 15 times 4?", "60"),
    ("What is 1 plus 2 plus 3?", "6"),
    ("What is 50 divided by 2?", "25"),
    ("What is 3 times 333?", "999"),
    ("How tall is the Eiffel Tower in metres?", "330"),
    ("In what year was the Eiffel Tower completed?", "1889"),
    ("Which planet is the largest in the Solar System?", "Jupiter"),
    ("What do honey bees make honey from?", "nectar"),
    ("How long is the Nile in kilometres?", "6650"),
    ("How high is Mount Everest in metres?", "8849"),
    ("Who created the Python programming language?", "Guido"),
    ("How many queens does a honey bee colony have?", "one"),
]


def _numbers(text: str) -> list[float]:
    return [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))]


def solved(answer: str, expected: str, question: str = "") -> bool:
    """A number must be stated once, with no other number than the question's ('1000 + 1000' does
    not answer 345 plus 655, '99 - 54' does not answer 99 minus 45, '17 * 23 = 391' answers 17
    times 23); a word must appear as a whole word."""
    if re.fullmatch(r"-?\d+(?:\.\d+)?", expected):
        want, nums, asked = float(expected), _numbers(answer), _numbers(question)
        others = [n for n in nums if n != want and n not in asked]
        # an expression in the answer counts only when it ends '= <the expected number>'
        expression = re.search(r"\d\s*[-+*/×÷^]\s*-?\d", answer)
        if expression and not re.search(rf"=\s*{re.escape(expected)}(?![\d.])", answer.replace(",", "")):
            return False
        return want in nums and not others and (nums.count(want) == 1 or want in asked)
    return re.search(rf"\b{re.escape(expected)}\b", answer, re.IGNORECASE) is not None


async def run_tasks(
    tasks: list[tuple[str, str]],
    inference: str,
    retrieval: str,
    key: str,
    mode: str,
    max_steps: int,
    search_top_k: int = 3,
) -> list[dict[str, Any]]:
    from services.agent.agents.runner import AgentRunner
    from services.agent.clients import InferenceClient, RetrievalClient
    from services.agent.tools.base import ToolContext
    from services.agent.tools.calculator import Calculator
    from services.agent.tools.search import DocumentSearch

    client = InferenceClient(inference, key)
    models = httpx.get(f"{inference}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
    model = models["data"][0]["id"]
    out = []
    for question, expected in tasks:
        runner = AgentRunner(
            client,
            model,
            {"calculator": Calculator(), "document_search": DocumentSearch(top_k=search_top_k)},
            ToolContext(retrieval=RetrievalClient(retrieval, key), collection="facts"),
            max_steps=max_steps,
            time_budget_s=120,
            max_tokens=96,
        )
        started = time.perf_counter()
        events = [e async for e in runner.run(question, [], mode=mode)]
        calls = [(e["tool"], e["input"]) for e in events if e.get("kind") == "tool_call"]
        r = runner.result
        row = {
            "question": question,
            "expected": expected,
            "answer": r.answer,
            "solved": solved(r.answer, expected, question),
            "calls": calls,
            "steps": r.steps,
            "finish": r.finish_reason,
            "seconds": round(time.perf_counter() - started, 1),
        }
        print(f"  [{'x' if row['solved'] else ' '}] {question} -> {r.answer!r} calls={calls} "
              f"steps={r.steps} {row['seconds']}s", flush=True)  # fmt: skip
        if os.environ.get("TOOL_TASKS_VERBOSE"):  # the last model call, for prompt work
            print(json.dumps({"prompt": r.prompt[-3:], "completion": r.completion}, indent=1)[:3000])
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tool-tasks", action="store_true")
    ap.add_argument("--mode", choices=["react", "openai", "both"], default="both")
    ap.add_argument("--only-calc", action="store_true", help="only the 4 calculator tasks")
    ap.add_argument("--only-search", action="store_true", help="only the 8 search tasks of the 20")
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument(
        "--search-top-k",
        type=int,
        default=AgentSettings.model_fields["search_tool_top_k"].default,
        help="passages the search tool returns (default: the agent service's)",
    )
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from benchmarks.agent.stack import bench_base
    from services.inference.app import create_app as create_inference
    from services.inference.config import InferenceSettings
    from services.retrieval.app import create_app as create_retrieval
    from services.retrieval.config import RetrievalSettings
    from tests.helpers.models import smollm2_dir
    from tests.helpers.servers import serve_app

    smollm2 = smollm2_dir()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        home = Path(tmp)
        _, key, base = bench_base(stack, home, smollm2)
        r_url = stack.enter_context(serve_app(create_retrieval(base, RetrievalSettings())))
        for _ in range(600):  # the embedder loads before the model (transformers' lazy imports)
            if httpx.get(f"{r_url}/readyz").status_code == 200:
                break
            time.sleep(0.2)
        i_url = stack.enter_context(serve_app(create_inference(base, InferenceSettings(model=str(smollm2)))))
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=r_url, headers=headers, timeout=300) as c:
            c.post("/v1/collections", json={"name": "facts"}).raise_for_status()
            c.post("/v1/collections/facts/documents", json={"documents": DOCS}).raise_for_status()
        modes = ["react", "openai"] if args.mode == "both" else [args.mode]
        sets = [("calculator (4)", CALC_TASKS)] + (
            [] if args.only_calc else [("tool tasks (20)", TOOL_TASKS)]
        )
        if args.only_search:
            sets = [("search tasks (8)", TOOL_TASKS[12:])]
        for mode in modes:
            for name, tasks in sets:
                print(f"{mode} / {name}:", flush=True)
                rows = asyncio.run(
                    run_tasks(tasks, i_url, r_url, key, mode, args.max_steps, args.search_top_k)
                )
                n = sum(r["solved"] for r in rows)
                print(f"{mode} / {name}: solved {n}/{len(rows)}", flush=True)
    return 0
