"""``python -m benchmarks.inference.prompt_lookup --cache DIR``: prompt-lookup decoding measured on
the ``chat-documents-generate`` pipeline's answers over real documents, with and without it, in one
run.

The prompts are the pipeline's own: for each question of the chosen answer sets (``--set``, default
``tuning``: thresholds and defaults are chosen on the tuning sets only), the sources its retrieval
steps found (a cache written by ``python -m benchmarks.answers.reader_eval collect``: one
``<set>.jsonl`` per set, over a running stack) go through the pipeline's prompt builder
(``BudgetPromptBuilder`` with the agent's settings and the model's tokenizer), and the answer is
asked as its generator asks it (the agent's ``max_answer_tokens`` and ``temperature``: greedy). The
default model is served in process by the torch engine as the server builds it (``TorchEngine``
defaults), the prompt lookup switched between rounds on the one engine; its prefix cache is
emptied before every pass so each pass computes the same prompts.

Per pass: ``--streams`` clients (a closed loop: each sends its next question when its answer
ended), tokens/s (answer tokens over the pass's wall time), the full-answer latency's median (p50)
and the acceptance rate (draft tokens accepted over draft tokens verified). Passes alternate
on/off for ``--rounds`` rounds (the machine's drift falls on both); the table gives the medians.
Greedy answers are checked to be the same token for token with and without.

``--sweep`` also prints, without running the model, what the lookup's sizes would do on the
answers of the first pass: greedy output does not change with drafts, so the steps a sequence
needs with each (tokens, min, max) follow from its answer alone.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from services.inference.engine.prompt_lookup import NgramIndex, PromptLookup, resolve


@dataclass
class Pass:
    mode: str
    streams: int
    tokens: int
    wall_s: float
    latencies: list[float]
    accepted: int
    draft_tokens: int
    outputs: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def pipeline_prompts(cache: Path, sets: str, tokenizer: Any, limit: int | None) -> list[list[dict[str, str]]]:
    """The messages ``chat-documents-generate`` sends the model for each cached question: its
    prompt step (``PromptNode`` with the pipeline's parameters, none) over the cached sources."""
    from types import SimpleNamespace

    from benchmarks.answers.sets import chosen_sets
    from services.agent.chunks import Chunk
    from services.agent.config import AgentSettings
    from services.agent.pipelines.components import PromptNode
    from services.agent.tokens import HFTokenCounter
    from services.common.config import load_settings

    settings = load_settings(AgentSettings, check_unknown=False)
    ctx = SimpleNamespace(settings=settings, counter=HFTokenCounter(tokenizer))
    builder = PromptNode(PromptNode.P.model_validate({})).builder(ctx)  # type: ignore[arg-type]
    out: list[list[dict[str, str]]] = []
    for name in chosen_sets(sets):
        path = cache / f"{name}.jsonl"
        if not path.exists():
            raise SystemExit(
                f"{path} is missing: run `python -m benchmarks.answers.reader_eval collect` first"
            )
        for line in path.read_text().splitlines():
            row = json.loads(line)
            chunks = [Chunk.from_result(s) for s in row["sources"]]
            if not chunks:
                continue  # the pipeline answers "not found" without the model
            plan = builder.build(row["asked"], [], chunks)
            out.append([{"role": m.role, "content": str(m.content)} for m in plan.messages])
    return out[:limit] if limit else out


def run_pass(engine: Any, prompts: list[list[int]], max_tokens: int, streams: int, mode: str) -> Pass:
    """Every prompt answered greedily by ``streams`` clients in a closed loop, inline on the
    engine's scheduler."""
    from services.inference.engine.scheduler import Sequence
    from services.inference.engine.types import SamplingParams

    sched = engine.scheduler
    sched.prefix_cache.clear()
    before = replace(sched.lookup_stats)
    pending = list(enumerate(prompts))
    started: dict[int, float] = {}
    latencies: list[float] = []
    outputs: dict[int, list[int]] = {}
    running: list[Sequence] = []
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)

    def submit() -> None:
        while pending and len(running) < streams:
            i, prompt = pending.pop(0)
            seq = Sequence(f"q{i}", i, prompt, params, max_tokens, lambda ev: None, None, None)
            started[i] = time.perf_counter()
            running.append(seq)
            sched.submit([seq], bounded=False)

    t0 = time.perf_counter()
    submit()
    while running:
        sched.step()
        for seq in [s for s in running if s.finish_reason is not None]:
            latencies.append(time.perf_counter() - started[seq.index])
            outputs[seq.index] = list(seq.output_ids)
            running.remove(seq)
        submit()
    wall = time.perf_counter() - t0
    stats = sched.lookup_stats
    return Pass(
        mode,
        streams,
        sum(len(o) for o in outputs.values()),
        wall,
        latencies,
        stats.accepted_tokens - before.accepted_tokens,
        stats.draft_tokens - before.draft_tokens,
        [outputs[i] for i in range(len(prompts))],
    )


def simulate(
    prompts: list[list[int]], outputs: list[list[int]], lookup: PromptLookup, max_tokens: int
) -> tuple[int, int, int, int]:
    """(steps, tokens, draft tokens, accepted) of greedy answers ``outputs`` decoded with ``lookup``
    (the scheduler's drafting, replayed against the answer it must give)."""
    steps = tokens = drafted = accepted = 0
    for prompt, answer in zip(prompts, outputs, strict=True):
        index = NgramIndex(prompt, lookup)
        done = 1  # the prompt's step gives the first token
        steps += 1
        while done < len(answer):
            room = max_tokens - done - 1
            draft = index.propose(answer[:done], room)
            ok = 0
            while ok < len(draft) and done + ok < len(answer) and draft[ok] == answer[done + ok]:
                ok += 1
            drafted += len(draft)
            accepted += ok
            done += ok + 1
            steps += 1
        tokens += len(answer)
    return steps, tokens, drafted, accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="reader_eval collect's cache folder")
    parser.add_argument("--set", default="tuning", help="answer sets: tuning (default), a name, or a list")
    parser.add_argument("--questions", type=int, default=0, help="the first N prompts only (0: all)")
    parser.add_argument("--streams", default="1,16", help="concurrent clients, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--modes",
        default="auto,off",
        help="TANDEM_INFERENCE_PROMPT_LOOKUP values compared (auto: the default)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--model", default=None, help="model folder or GGUF (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--sweep", action="store_true", help="also replay lookup sizes on the answers")
    parser.add_argument("--json", type=Path, default=None, help="write every pass here")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from services.agent.config import AgentSettings
    from services.common.config import CommonSettings, load_settings
    from services.inference.engine import TorchEngine
    from services.inference.engine.loader import resolve_model
    from services.inference.engines import cache_root

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model, cache_root(CommonSettings()))  # type: ignore[call-arg]
    tokenizer = AutoTokenizer.from_pretrained(path)
    messages = pipeline_prompts(args.cache, args.set, tokenizer, args.questions or None)
    engine = TorchEngine.from_pretrained(path, num_threads=args.threads)  # type: ignore[attr-defined]
    engine.runner.prepare_weights()
    lookup = PromptLookup()
    modes = args.modes.split(",")
    prompts = [engine.encode_chat(m) for m in messages]
    max_tokens = load_settings(AgentSettings, check_unknown=False).max_answer_tokens
    streams = [int(s) for s in args.streams.split(",")]
    print(
        f"{cpu_name()}, {torch.get_num_threads()} threads; {len(prompts)} chat-documents-generate prompts "
        f"({args.set}), {statistics.mean(map(len, prompts)):.0f} tokens on average; answers up to "
        f"{max_tokens} tokens, greedy; lookup {lookup.describe()}; plan {engine.plan.line()}"
    )
    passes: list[Pass] = []
    for r in range(args.rounds):
        for n in streams:
            for mode in modes if r % 2 == 0 else modes[::-1]:
                engine.scheduler.prompt_lookup = resolve(mode, "cpu", lookup)  # type: ignore[arg-type]
                p = run_pass(engine, prompts, max_tokens, n, mode)
                passes.append(p)
                print(
                    f"round {r + 1} streams {n:2d} lookup {mode:3s}: {p.tokens_per_s:6.1f} tokens/s, "
                    f"p50 {p.p50:5.2f} s, acceptance {p.acceptance:.2f} ({p.tokens} tokens, {p.wall_s:.0f} s)",
                    flush=True,
                )
    reference = passes[0].outputs
    same = all(p.outputs == reference for p in passes)
    print(f"\ngreedy answers the same in every pass: {same}")
    print("\n| streams | lookup | tokens/s | full-answer p50 (s) | acceptance |\n|---:|---|---:|---:|---:|")
    for n in streams:
        for mode in modes:
            ps = [p for p in passes if p.streams == n and p.mode == mode]
            rate = statistics.median(p.acceptance for p in ps)
            drafted = sum(p.draft_tokens for p in ps)
            print(
                f"| {n} | {mode} | {statistics.median(p.tokens_per_s for p in ps):.1f} | "
                f"{statistics.median(p.p50 for p in ps):.2f} | {f'{rate:.2f}' if drafted else '-'} |"
            )
    if args.sweep:
        print(
            "\n| tokens | min | max | steps / answer token | draft tokens | acceptance |\n|---:|---:|---:|---:|---:|---:|"
        )
        for tokens in (2, 4, 6, 8):
            for lo, hi in ((1, 3), (2, 3), (2, 4), (3, 5), (4, 6)):
                steps, total, drafted, ok = simulate(
                    prompts, reference, PromptLookup(tokens, lo, hi), max_tokens
                )
                rate = ok / drafted if drafted else 0.0
                print(f"| {tokens} | {lo} | {hi} | {steps / total:.3f} | {drafted} | {rate:.2f} |")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                [
                    {k: v for k, v in vars(p).items() if k != "outputs"}
                    | {"tokens_per_s": p.tokens_per_s, "p50": p.p50}
                    for p in passes
                ],
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
