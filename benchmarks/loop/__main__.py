"""Benchmark: what one turn of the learning loop changes, on questions it did not train on.

``python -m benchmarks.loop [--user approving|strict] [--format auto|kto|sft|dpo] [--hyperparameters JSON]
[--train 200] [--eval 100] [--concurrency 8] [--out FILE]``

Starts the whole stack with ``tandem up`` in a temporary home (embedded Valkey, the
four services, the Celery workers, the default SmolLM2-135M), builds a collection of
documents holding invented facts (``services.cli.factset``, fixed seed), and then plays
a scripted user through the public APIs only:

1. asks ``--train`` questions with ``chat-documents-generate`` (the model writes each answer)
   on the base model and judges each answer. The ``approving`` user gives a thumbs up when
   the answer shown has a valid ``[n]`` and states the expected fact; the ``strict`` user
   only when the model wrote that answer itself (its own completion has the marker and the
   fact, and the groundedness guard did not replace it with source sentences). Both give a
   thumbs down otherwise, and for every second answer turned down a correction: the
   source's sentence that states the fact, followed by that source's ``[n]`` (the number
   the prompt gave that source);
2. asks ``--eval`` other questions (their documents are in the same collection; the
   training never saw them) on the base model;
3. clicks "train on feedback" (``POST /v1/feedback/train``: a LoRA job of ``--format``, by
   default ``auto``, the agent's choice of ``kto`` or ``dpo``, with ``--hyperparameters`` or
   none, published when done), waits for the adapter to answer, and for the promotion gate's
   verdict (``GET /v1/promotions``);
4. asks the same unseen questions with ``llm`` = the adapter, and once more with no ``llm``:
   what the tenant's chat serves after the gate (the adapter if it was promoted).

Reports, for the base model, the adapter and the served model after the gate, on the unseen
questions: the share of answers with a valid model-written ``[n]`` marker, the share stating
the expected fact, the share citing the right document; the wall time from "train on
feedback" to the adapter's first answer; the gate's decision with its figures; and the live
quality (``GET /v1/quality``) of the served model before and after. Targets on a 2-core CPU:
marker rate >= 60 % with the approving user (issue 13), >= 50 % with the strict one (issue
35), the fact rate does not fall, the round within 20 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.stack import embedded_stack
from services.agent.citations import marker_numbers
from services.cli.factset import Fact, make_facts, states

COLLECTION = "facts"


@dataclass
class Answer:
    fact_id: str
    message_id: str
    answer: str
    sources: int
    marker: bool  # the model wrote a valid [n] itself (in its raw completion)
    fact: bool  # the model's completion states the expected answer string
    right_doc: bool  # a citation (written or attributed) points at the fact's document
    seconds: float
    shown_ok: bool  # what the user saw has a valid [n] and states the fact (the approving user's rule)
    own_ok: bool  # the model wrote what the user saw, with a valid [n] and the fact (the strict user's)


@dataclass
class Rates:
    n: int
    marker: float
    fact: float
    right_doc: float
    p50_s: float

    @classmethod
    def of(cls, answers: list[Answer]) -> Rates:
        n = max(len(answers), 1)
        return cls(
            n=len(answers),
            marker=sum(a.marker for a in answers) / n,
            fact=sum(a.fact for a in answers) / n,
            right_doc=sum(a.right_doc for a in answers) / n,
            p50_s=statistics.median([a.seconds for a in answers]) if answers else float("nan"),
        )


@dataclass
class Report:
    user: str
    format: str
    train_answers: int
    thumbs_up: int
    thumbs_down: int
    corrections: int
    dataset: dict[str, Any] = field(default_factory=dict)
    job: dict[str, Any] = field(default_factory=dict)
    base: Rates | None = None
    adapter: Rates | None = None
    served_after: Rates | None = None
    train_to_answer_s: float = 0.0
    adapter_name: str = ""
    promotion: dict[str, Any] = field(default_factory=dict)
    live_before: list[dict[str, Any]] = field(default_factory=list)
    live_after: list[dict[str, Any]] = field(default_factory=list)


class PatientTransport(httpx.AsyncHTTPTransport):
    """A user's client that waits out a 429 (the tenant's request rate) as told and asks again."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        while True:
            resp = await super().handle_async_request(request)
            if resp.status_code != 429:
                return resp
            await resp.aclose()
            await asyncio.sleep(max(float(resp.headers.get("retry-after") or 1.0), 0.1))


class Client:
    """The scripted user's view of the stack: the agent's and the other services' public APIs."""

    def __init__(self, env: dict[str, str], key: str) -> None:
        self.headers = {"Authorization": f"Bearer {key}"}
        self.agent = f"http://127.0.0.1:{env['TANDEM_AGENT_PORT']}"
        self.retrieval = f"http://127.0.0.1:{env['TANDEM_RETRIEVAL_PORT']}"
        self.trainer = f"http://127.0.0.1:{env['TANDEM_TRAINER_PORT']}"
        self.http = httpx.AsyncClient(headers=self.headers, timeout=600, transport=PatientTransport())

    async def check(self, resp: httpx.Response) -> Any:
        if resp.status_code >= 400:
            raise RuntimeError(
                f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text[:500]}"
            )
        return resp.json() if resp.content else None

    async def ingest(self, facts: list[Fact]) -> None:
        await self.check(await self.http.post(f"{self.retrieval}/v1/collections", json={"name": COLLECTION}))
        docs = [{"id": f.fact_id, "title": f.title, "text": f.text} for f in facts]
        body = await self.check(
            await self.http.post(
                f"{self.retrieval}/v1/collections/{COLLECTION}/documents", json={"documents": docs}
            )
        )
        job_id = body.get("job_id")
        while job_id:
            job = await self.check(await self.http.get(f"{self.retrieval}/v1/jobs/{job_id}"))
            if job["state"] in ("succeeded", "failed"):
                if job["state"] == "failed":
                    raise RuntimeError(f"ingestion failed: {job.get('error')}")
                break
            await asyncio.sleep(1)

    async def ask(self, fact: Fact, llm: str | None) -> Answer:
        body: dict[str, Any] = {"query": fact.question, "collection": COLLECTION}
        if llm:
            body["llm"] = llm
        start = time.perf_counter()
        out = await self.check(
            await self.http.post(f"{self.agent}/v1/pipelines/chat-documents-generate/run", json=body)
        )
        seconds = time.perf_counter() - start
        record = await self.check(await self.http.get(f"{self.agent}/v1/messages/{out['message_id']}"))
        sources = len(record.get("chunk_ids") or [])
        answer = out.get("answer") or ""
        # What the model wrote, before any guard of the pipeline replaced or trimmed it.
        completion = record.get("completion") or answer

        def has_marker(text: str) -> bool:
            return any(1 <= n <= sources for n in marker_numbers(text))

        docs = {c.get("document_id") for c in out.get("citations") or []}
        return Answer(
            fact_id=fact.fact_id,
            message_id=out["message_id"],
            answer=answer,
            sources=sources,
            marker=has_marker(completion),
            fact=states(completion, fact.answer),
            right_doc=fact.fact_id in docs,
            seconds=seconds,
            shown_ok=has_marker(answer) and states(answer, fact.answer),
            own_ok=out.get("answer_kind", "generated") == "generated"
            and answer.strip() == completion.strip()
            and has_marker(completion)
            and states(completion, fact.answer),
        )

    async def source_number(self, message_id: str, fact: Fact) -> int | None:
        """The number the prompt gave the source holding the fact's sentence, if it was shown."""
        record = await self.check(await self.http.get(f"{self.agent}/v1/messages/{message_id}"))
        prompt = "\n".join(str(m.get("content", "")) for m in record["prompt"])
        for line in prompt.splitlines():
            if fact.sentence in line and line.startswith("["):
                number = line[1 : line.index("]")]
                if number.isdigit():
                    return int(number)
        return None

    async def feedback(self, message_id: str, rating: int, correction: str | None = None) -> None:
        body: dict[str, Any] = {"message_id": message_id, "rating": rating}
        if correction:
            body["correction"] = correction
        await self.check(await self.http.post(f"{self.agent}/v1/feedback", json=body))

    async def quality(self, since: float) -> list[dict[str, Any]]:
        """The live quality report (one bucket a week) of the answers since ``since``."""
        params: dict[str, str | float] = {"since": since, "bucket": "week"}
        out = await self.check(await self.http.get(f"{self.agent}/v1/quality", params=params))
        return list(out["data"])

    async def promotion(self, job_id: str, timeout: float) -> dict[str, Any]:
        """The promotion gate's verdict on the job's adapter, once it has one."""
        deadline = time.monotonic() + timeout
        while True:
            out = await self.check(await self.http.get(f"{self.agent}/v1/promotions"))
            for p in out["data"]:
                if p["job_id"] == job_id and p["status"] not in ("training", "evaluating"):
                    return {"choice": out["choice"], **p}
            if time.monotonic() > deadline:
                raise RuntimeError(f"the promotion gate did not decide on {job_id} in {timeout} s")
            await asyncio.sleep(2)


async def ask_all(client: Client, facts: list[Fact], llm: str | None, concurrency: int) -> list[Answer]:
    gate = asyncio.Semaphore(concurrency)

    async def one(fact: Fact) -> Answer:
        async with gate:
            return await client.ask(fact, llm)

    return list(await asyncio.gather(*(one(f) for f in facts)))


async def wait_for_adapter(
    client: Client, job_id: str, probe: Fact, timeout: float
) -> tuple[dict[str, Any], str]:
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        job = await client.check(await client.http.get(f"{client.trainer}/v1/jobs/{job_id}"))
        status = f"{job['status']} {job['progress']['step']}/{job['progress']['total']}"
        if status != last:
            print(f"  job {job_id}: {status}", flush=True)
            last = status
        if job["status"] in ("failed", "cancelled"):
            raise RuntimeError(f"training job {job['status']}: {job.get('error')}")
        if job["status"] == "succeeded" and job.get("published") and job.get("fine_tuned_model"):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"training job not done after {timeout} s ({status})")
        await asyncio.sleep(2)
    name = str(job["fine_tuned_model"])
    await client.ask(probe, name)  # the adapter answers
    return job, name


async def run(args: argparse.Namespace, env: dict[str, str], key: str) -> Report:
    facts = make_facts(args.train + args.eval, seed=args.seed)
    train, unseen = facts[: args.train], facts[args.train :]
    client = Client(env, key)
    print(f"ingesting {len(facts)} documents ...", flush=True)
    await client.ingest(facts)

    print(
        f"asking {len(train)} questions on the base model and judging them ({args.user} user) ...", flush=True
    )
    answers = await ask_all(client, train, None, args.concurrency)
    ups = downs = corrections = 0
    by_id = {f.fact_id: f for f in train}
    for a in answers:
        fact = by_id[a.fact_id]
        if a.shown_ok if args.user == "approving" else a.own_ok:
            await client.feedback(a.message_id, 1)
            ups += 1
            continue
        downs += 1
        correction = None
        if downs % 2 == 0:
            number = await client.source_number(a.message_id, fact)
            if number is not None:
                correction = f"{fact.sentence} [{number}]"
                corrections += 1
        await client.feedback(a.message_id, -1, correction)
    report = Report(
        user=args.user,
        format=args.format,
        train_answers=len(answers),
        thumbs_up=ups,
        thumbs_down=downs,
        corrections=corrections,
    )
    print(f"  {ups} up, {downs} down, {corrections} corrections", flush=True)

    print(f"asking {len(unseen)} unseen questions on the base model ...", flush=True)
    since = time.time()
    report.base = Rates.of(await ask_all(client, unseen, None, args.concurrency))
    report.live_before = await client.quality(since)

    print(f"train on feedback ({args.format}) ...", flush=True)
    started = time.perf_counter()
    train_body: dict[str, Any] = {"format": args.format}
    if args.hyperparameters:
        train_body["hyperparameters"] = json.loads(args.hyperparameters)
    out = await client.check(await client.http.post(f"{client.agent}/v1/feedback/train", json=train_body))
    report.dataset = out["dataset"]
    job, name = await wait_for_adapter(client, out["job"]["id"], unseen[0], args.timeout)
    report.train_to_answer_s = time.perf_counter() - started
    report.job = {k: job.get(k) for k in ("id", "type", "status", "metrics", "progress", "request")}
    report.adapter_name = name

    print("waiting for the promotion gate ...", flush=True)
    report.promotion = await client.promotion(job["id"], args.timeout)
    print(f"  {report.promotion['status']}: {report.promotion['reason']}", flush=True)

    print(f"asking the unseen questions with {name} ...", flush=True)
    report.adapter = Rates.of(await ask_all(client, unseen, name, args.concurrency))
    print("asking the unseen questions as the tenant's chat serves them now ...", flush=True)
    since = time.time()
    report.served_after = Rates.of(await ask_all(client, unseen, None, args.concurrency))
    report.live_after = await client.quality(since)
    await client.http.aclose()
    return report


def table(report: Report) -> str:
    assert report.base is not None and report.adapter is not None and report.served_after is not None
    p = report.promotion
    served = (p.get("choice") or {}).get("default") or "base SmolLM2-135M"
    rows = [
        "| model | unseen questions | model-written [n] | fact stated | right document cited | answer p50 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, r in (
        ("base SmolLM2-135M", report.base),
        (f"adapter {report.adapter_name}", report.adapter),
        (f"served after the gate ({served})", report.served_after),
    ):
        rows.append(
            f"| {label} | {r.n} | {r.marker:.0%} | {r.fact:.0%} | {r.right_doc:.0%} | {r.p50_s:.1f} s |"
        )
    rows.append("")
    rows.append(
        f"Feedback ({report.user} user): {report.train_answers} answers, {report.thumbs_up} up, "
        f"{report.thumbs_down} down, {report.corrections} corrections; {report.dataset.get('format')} dataset "
        f"{report.dataset.get('rows')} rows {report.dataset.get('counts')}; train on feedback -> adapter "
        f"answering: {report.train_to_answer_s / 60:.1f} min"
    )
    rows.append("")
    rows.append(f"Promotion gate: **{p.get('status')}**: {p.get('reason')}")
    rows.append("")
    rows.append("| set | questions | model | answered | matches reference | grounded | cited |")
    rows.append("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for s in p.get("sets") or []:
        for side in ("candidate", "current"):
            sc = s[side]
            rows.append(
                f"| {s['name']} | {s['questions']} | {side} | {sc['answered']} | {_share(sc['matches'])} | "
                f"{_share(sc['grounded'])} | {_share(sc['cited'])} |"
            )
    rows.append("")
    rows.append("Live quality (GET /v1/quality) of the unseen questions as served:")
    rows.append("")
    rows.append("| when | model | answers | groundedness mean | cited | extractive | not found |")
    rows.append("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for when, points in (("before", report.live_before), ("after", report.live_after)):
        for q in points:
            rows.append(
                f"| {when} | {q['model']} | {q['answers']} | {_share(q['groundedness_mean'])} | "
                f"{q['cited_share']:.0%} | {q['extractive_share']:.0%} | {q['not_found_share']:.0%} |"
            )
    return "\n".join(rows)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--user", choices=("approving", "strict"), default="approving", help="the scripted user")
    ap.add_argument(
        "--format", choices=("auto", "kto", "sft", "dpo"), default="auto", help="train on feedback's format"
    )
    ap.add_argument(
        "--hyperparameters", default="", help="JSON object passed with train on feedback (default: none)"
    )
    ap.add_argument("--train", type=int, default=200, help="answers the scripted user gives feedback on")
    ap.add_argument("--eval", type=int, default=100, help="unseen questions asked before and after")
    ap.add_argument("--concurrency", type=int, default=8, help="questions in flight at once")
    ap.add_argument("--seed", type=int, default=13, help="seed of the invented facts")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds to wait for the training job")
    ap.add_argument("--out", type=Path, help="write the report as JSON here")
    ap.add_argument("--keep", action="store_true", help="leave the stack running (prints its home)")
    args = ap.parse_args(argv)

    try:
        with embedded_stack("tandem-loop-", keep=args.keep) as stack:
            report = asyncio.run(run(args, stack.env, stack.key))
    except RuntimeError as exc:  # tandem up failed: its output says why
        print(exc, file=sys.stderr)
        return 1
    print()
    print(table(report))
    if args.out:
        args.out.write_text(json.dumps(asdict(report), indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
