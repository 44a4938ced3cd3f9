"""Does the tools agent call the MCP server a request names? The default model, real MCP servers.

``python -m benchmarks.agent.named_server [--runs 10] [--mode openai|react]``

Starts an embedded Valkey, the inference service on SmolLM2-135M-Instruct (the default model) as
its own uvicorn process (as ``tandem up`` runs it), the agent service in this process over real
HTTP, and three MCP servers written with
the official SDK's server API (Streamable HTTP): a unit converter, a world clock and a dictionary,
their tools marked read-only. All three are registered for ``tools-agent`` (so every run is offered
all their tools, the calculator too); each question names one server in ``mcp_servers`` and gives
no collection, as a user of a chat front end does. A run counts when the agent calls the named
server's tool (and, reported beside it, when that is its first call); the answer is shown too.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

# Plain questions a user of each server asks, written for these tools: (server, question).
QUESTIONS = [
    ("units", "How many miles is 42 kilometres?"),
    ("clock", "What time is it in Tokyo right now?"),
    ("dictionary", "What does the word 'ephemeral' mean?"),
    ("units", "Convert 3 miles to kilometres."),
    ("clock", "What is the local time in Lima?"),
    ("dictionary", "Define 'serendipity'."),
    ("units", "How many feet are in 10 metres?"),
    ("clock", "Is it morning or evening in Sydney now?"),
    ("dictionary", "What is the meaning of 'laconic'?"),
    ("units", "What is 100 kilograms in pounds?"),
]

_FACTORS = {("km", "mi"): 0.621371, ("mi", "km"): 1.609344, ("m", "ft"): 3.28084, ("kg", "lb"): 2.204623}
_CLOCKS = {"tokyo": "18:05", "lima": "04:05", "sydney": "20:05", "london": "09:05"}
_WORDS = {
    "ephemeral": "lasting a very short time",
    "serendipity": "finding something good without looking for it",
    "laconic": "using very few words",
}


def mcp_servers() -> dict[str, Any]:
    """The three servers (the SDK's ``MCPServer``), by name. Answers are fixed, so a run depends on
    the model only."""
    from mcp.server.mcpserver import MCPServer
    from mcp.types import ToolAnnotations

    read_only = ToolAnnotations(read_only_hint=True)
    units, clock, dictionary = MCPServer("units"), MCPServer("clock"), MCPServer("dictionary")

    @units.tool(
        description="Converts an amount from one unit to another (km, mi, m, ft, kg, lb).",
        annotations=read_only,
    )
    def convert(amount: float, from_unit: str, to_unit: str) -> str:
        factor = _FACTORS.get((from_unit.lower(), to_unit.lower()))
        if factor is None:
            return f"cannot convert {from_unit} to {to_unit}"
        return f"{amount:g} {from_unit} = {amount * factor:.2f} {to_unit}"

    @clock.tool(description="The current local time in a city.", annotations=read_only)
    def local_time(city: str) -> str:
        return f"It is {_CLOCKS.get(city.strip().lower(), '12:05')} in {city}."

    @dictionary.tool(description="The definition of an English word.", annotations=read_only)
    def define(word: str) -> str:
        word = word.strip().strip("'\"").lower()
        return f"{word}: {_WORDS.get(word, 'not in this dictionary')}"

    return {"units": units, "clock": clock, "dictionary": dictionary}


@contextmanager
def served_servers() -> Iterator[dict[str, str]]:
    """Each server on 127.0.0.1 (Streamable HTTP, stateless, JSON answers): name -> URL."""
    from tests.helpers.mcp import serve_mcp

    with ExitStack() as stack:
        yield {name: stack.enter_context(serve_mcp(server)) for name, server in mcp_servers().items()}


def ask(agent: str, key: str, server: str, question: str) -> dict[str, Any]:
    body = {"query": question, "mcp_servers": [server]}
    resp = httpx.post(
        f"{agent}/v1/pipelines/tools-agent/run",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=300,
    )
    resp.raise_for_status()
    out: dict[str, Any] = resp.json()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=len(QUESTIONS), help="questions asked (at most 10)")
    ap.add_argument("--mode", choices=["openai", "react"], default="openai", help="TANDEM_AGENT_TOOL_CALLING")
    ap.add_argument(
        "--budget", type=float, default=600.0, help="seconds one run (and one model call) may take"
    )
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from benchmarks.agent.stack import bench_base, free_port, service_env, start_service, wait_ready
    from services.agent.app import create_app as create_agent
    from services.agent.config import AgentSettings
    from tests.helpers.models import smollm2_dir
    from tests.helpers.servers import serve_app

    smollm2 = smollm2_dir()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        home = Path(tmp)
        redis_url, key, base = bench_base(stack, home, smollm2)
        port = free_port()
        env = service_env(
            home,
            redis_url,
            TANDEM_MODEL_ROOTS=f"{home}:{smollm2.parent}",
            TANDEM_INFERENCE_MODEL=str(smollm2),
            TANDEM_INFERENCE_PORT=str(port),
        )
        inference = start_service("inference", port, env, home)
        stack.callback(inference.terminate)
        i_url = f"http://127.0.0.1:{port}"
        wait_ready(i_url, inference)
        common = base.model_copy(update={"inference_url": i_url})
        # budgets for a shared CPU: this measures which tool the model calls, not how fast
        settings = AgentSettings(
            mcp_allow_private=True,
            tool_calling=args.mode,
            agent_time_budget_s=args.budget,
            upstream_timeout_s=args.budget,
        )
        agent = stack.enter_context(serve_app(create_agent(common, settings)))
        urls = stack.enter_context(served_servers())
        headers = {"Authorization": f"Bearer {key}"}
        for name, url in urls.items():
            body = {"name": name, "url": url, "agents": ["tools-agent"]}
            httpx.post(f"{agent}/v1/mcp/servers", json=body, headers=headers, timeout=30).raise_for_status()
        called = first = 0
        started = time.perf_counter()
        for server, question in QUESTIONS[: args.runs]:
            t0 = time.perf_counter()
            answer = ask(agent, key, server, question)
            calls = [s["tool"] for s in answer["steps"] if s["kind"] == "tool_call"]
            hit = any(c.startswith(f"{server}__") for c in calls)
            called += hit
            first += bool(calls) and calls[0].startswith(f"{server}__")
            print(
                f"  [{'x' if hit else ' '}] {server}: {question} -> calls={calls} "
                f"answer={answer['answer']!r} {time.perf_counter() - t0:.1f}s",
                flush=True,
            )
        runs = min(args.runs, len(QUESTIONS))
        print(
            f"{args.mode}: the named server's tool called in {called}/{runs} runs, "
            f"as the first call in {first}/{runs} "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
