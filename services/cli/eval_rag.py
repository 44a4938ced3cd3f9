"""``tandem eval rag --beir DIR`` / ``--facts N``: asks questions through ``chat-documents``.

With ``--facts N --seed S`` the questions are about invented facts (services/cli/factset.py:
no model can know them, nothing to download) and each answer is judged against its
expected answer: see ``FactOutcome`` and ``run_facts_eval`` below.

With ``--beir DIR`` it asks a BEIR data set's queries.

Reports, over the queries asked:

- cited-chunk relevance: of the chunks the answers cite with ``[n]``, the share whose
  document is relevant to the query in the qrels;
- citation validity: of all ``[n]`` markers written, the share naming a chunk that was
  actually shown to the model (the rest are invalid: a number with no source);
- answers with at least one (valid) citation;
- first-token and total latency, p50 and p95, measured at the client over SSE.

Citations the server *attributed* to an uncited answer are reported on their own
line and never counted as the model's citations.
"""

from __future__ import annotations

import csv
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from services.common.config import CommonSettings, load_settings
from services.common.openai_stream import iter_sse

console = Console()


@dataclass
class BeirSet:
    corpus: dict[str, dict[str, str]]
    queries: dict[str, str]
    qrels: dict[str, set[str]]


def load_beir(folder: Path, split: str = "test") -> BeirSet:
    def jsonl(path: Path) -> list[dict[str, Any]]:
        with path.open(encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]

    for name in ("corpus.jsonl", "queries.jsonl", f"qrels/{split}.tsv"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} is missing (expected BEIR layout)")
    corpus = {
        str(d["_id"]): {"title": str(d.get("title") or ""), "text": str(d.get("text") or "")}
        for d in jsonl(folder / "corpus.jsonl")
    }
    queries = {str(q["_id"]): str(q["text"]) for q in jsonl(folder / "queries.jsonl")}
    qrels: dict[str, set[str]] = {}
    with (folder / f"qrels/{split}.tsv").open(encoding="utf-8") as fh:
        for row in csv.reader(fh, delimiter="\t"):
            if len(row) < 3 or row[0] == "query-id":
                continue
            if int(row[2]) > 0:
                qrels.setdefault(row[0], set()).add(row[1])
    return BeirSet(corpus, queries, qrels)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[idx]


@dataclass
class QueryOutcome:
    query_id: str
    answer: str
    cited_docs: list[str]
    attributed_docs: list[str]
    markers: int
    invalid: int
    first_token_s: float | None
    total_s: float
    error: str | None = None


class RagSummary(TypedDict):
    """A BEIR run's figures (``RagReport.summary``), printed and written to --json as they are."""

    queries: int
    errors: int
    cited_chunk_relevance: float | None
    cited_chunks: int
    citation_validity: float | None
    markers: int
    answers_with_citation: float | None
    attributed_relevance: float | None
    answers_attributed_only: float | None
    first_token_p50_s: float
    first_token_p95_s: float
    total_p50_s: float
    total_p95_s: float


@dataclass
class RagReport:
    outcomes: list[QueryOutcome] = field(default_factory=list)
    qrels: dict[str, set[str]] = field(default_factory=dict)

    def summary(self) -> RagSummary:
        ok = [o for o in self.outcomes if o.error is None]
        cited = [(o.query_id, d) for o in ok for d in o.cited_docs]
        attributed = [(o.query_id, d) for o in ok for d in o.attributed_docs]
        markers = sum(o.markers for o in ok)
        invalid = sum(o.invalid for o in ok)
        firsts = [o.first_token_s for o in ok if o.first_token_s is not None]
        totals = [o.total_s for o in ok]

        def rel(pairs: list[tuple[str, str]]) -> float | None:
            return sum(1 for q, d in pairs if d in self.qrels.get(q, set())) / len(pairs) if pairs else None

        return {
            "queries": len(self.outcomes),
            "errors": len(self.outcomes) - len(ok),
            "cited_chunk_relevance": rel(cited),
            "cited_chunks": len(cited),
            "citation_validity": (markers - invalid) / markers if markers else None,
            "markers": markers,
            "answers_with_citation": sum(1 for o in ok if o.cited_docs) / len(ok) if ok else None,
            "attributed_relevance": rel(attributed),
            "answers_attributed_only": sum(1 for o in ok if o.attributed_docs and not o.cited_docs) / len(ok)
            if ok
            else None,
            "first_token_p50_s": percentile(firsts, 50),
            "first_token_p95_s": percentile(firsts, 95),
            "total_p50_s": percentile(totals, 50),
            "total_p95_s": percentile(totals, 95),
        }


def ingest(
    client: httpx.Client, collection: str, data: BeirSet, batch: int = 64, timeout: float = 3600
) -> int:
    """Creates the collection and posts the corpus in batches (waiting for any that became jobs)."""
    resp = client.post("/v1/collections", json={"name": collection})
    if resp.status_code == 409:
        return 0
    resp.raise_for_status()
    docs = [
        {"id": k, "title": v["title"], "text": v["text"]} for k, v in data.corpus.items() if v["text"].strip()
    ]
    for i in range(0, len(docs), batch):
        resp = client.post(f"/v1/collections/{collection}/documents", json={"documents": docs[i : i + batch]})
        resp.raise_for_status()
        job = resp.json().get("job_id")
        deadline = time.monotonic() + timeout
        while job:
            state = client.get(f"/v1/jobs/{job}").json()
            if state["state"] == "succeeded":
                break
            if state["state"] == "failed" or time.monotonic() > deadline:
                raise RuntimeError(f"ingestion job {job} {state['state']}: {state.get('error')}")
            time.sleep(0.5)
    return len(docs)


def ask(
    client: httpx.Client, pipeline: str, collection: str, query: str, llm: str | None = None
) -> dict[str, Any]:
    started = time.perf_counter()
    first: float | None = None
    answer: list[str] = []
    done: dict[str, Any] = {}
    error: str | None = None
    with client.stream(
        "POST",
        f"/v1/pipelines/{pipeline}/run",
        json={"query": query, "collection": collection, "stream": True, **({"llm": llm} if llm else {})},
    ) as resp:
        if resp.status_code >= 400:
            resp.read()
            return {
                "error": f"HTTP {resp.status_code}: {resp.text[:200]}",
                "total": time.perf_counter() - started,
            }
        for sse in iter_sse(resp.iter_lines()):
            event = json.loads(sse.data)
            if event["type"] == "token":
                if first is None:
                    first = time.perf_counter() - started
                answer.append(event["text"])
            elif event["type"] == "reset":
                answer.clear()  # the groundedness guard replaces the streamed answer
            elif event["type"] == "done":
                done = event
            elif event["type"] == "error":
                error = event.get("message")
    return {
        "answer": "".join(answer),
        "done": done,
        "first": first,
        "total": time.perf_counter() - started,
        "error": error,
    }


def run_rag_eval(
    data: BeirSet,
    *,
    agent_url: str,
    retrieval_url: str,
    api_key: str,
    collection: str,
    limit: int,
    do_ingest: bool = True,
    pipeline: str = "chat-documents",
    timeout: float = 300.0,
    distractors: int | None = None,
) -> RagReport:
    from services.agent.citations import marker_numbers

    headers = {"Authorization": f"Bearer {api_key}"}
    query_ids = [q for q in sorted(data.qrels) if q in data.queries][:limit]
    if distractors is not None:
        # A slice for quick runs: the judged documents of the asked queries plus some others.
        judged = {d for q in query_ids for d in data.qrels[q] if d in data.corpus}
        others = [d for d in data.corpus if d not in judged][:distractors]
        data = BeirSet({d: data.corpus[d] for d in [*judged, *others]}, data.queries, data.qrels)
    if do_ingest:
        with httpx.Client(base_url=retrieval_url, headers=headers, timeout=timeout) as rc:
            ingest(rc, collection, data)
    report = RagReport(qrels=data.qrels)
    with httpx.Client(base_url=agent_url, headers=headers, timeout=timeout) as ac:
        for qid in query_ids:
            out = ask(ac, pipeline, collection, data.queries[qid])
            done = out.get("done") or {}
            cites = done.get("citations") or []
            answer = str(out.get("answer") or "")
            report.outcomes.append(
                QueryOutcome(
                    query_id=qid,
                    answer=answer,
                    # "[n]" in the answer: the model's markers, or the answer step's sentences
                    cited_docs=[
                        c["document_id"] for c in cites if c.get("kind", "cited") in ("cited", "extractive")
                    ],
                    attributed_docs=[c["document_id"] for c in cites if c.get("kind") == "attributed"],
                    markers=len(marker_numbers(answer)),
                    invalid=len(done.get("invalid_citations") or []),
                    first_token_s=out.get("first"),
                    total_s=float(out["total"]),
                    error=out.get("error"),
                )
            )
    return report


def print_summary(summary: RagSummary) -> None:
    def fmt(v: Any, pct: bool = False) -> str:
        if v is None:
            return "n/a"
        return f"{100 * v:.1f}%" if pct else (f"{v:.3f}" if isinstance(v, float) else str(v))

    table = Table(title="chat-documents RAG evaluation")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("queries (errors)", f"{summary['queries']} ({summary['errors']})"),
        (
            "cited-chunk relevance",
            f"{fmt(summary['cited_chunk_relevance'], True)} of {summary['cited_chunks']}",
        ),
        ("citation validity", f"{fmt(summary['citation_validity'], True)} of {summary['markers']} markers"),
        ("answers with >=1 citation", fmt(summary["answers_with_citation"], True)),
        ("server-attributed only (not counted above)", fmt(summary["answers_attributed_only"], True)),
        ("attributed-chunk relevance", fmt(summary["attributed_relevance"], True)),
        (
            "first token p50 / p95 (s)",
            f"{fmt(summary['first_token_p50_s'])} / {fmt(summary['first_token_p95_s'])}",
        ),
        ("total p50 / p95 (s)", f"{fmt(summary['total_p50_s'])} / {fmt(summary['total_p95_s'])}"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)


def rag_command(
    beir: Path | None = typer.Option(
        None, "--beir", help="BEIR folder: corpus.jsonl, queries.jsonl, qrels/test.tsv."
    ),
    questions: Path | None = typer.Option(
        None,
        "--questions",
        help="Instead of --beir: a question set (JSONL, services/cli/eval_questions.py) asked over "
        "--collection, an existing collection of its documents.",
    ),
    facts: int | None = typer.Option(
        None,
        "--facts",
        min=1,
        max=2000,
        help="Instead of --beir: ask this many questions about invented facts (generated, nothing to fetch).",
    ),
    seed: int = typer.Option(1, help="Seed of the invented facts (--facts); another seed, another set."),
    llm: str = typer.Option("", help="Model to answer with (default: the agent's)."),
    show: bool = typer.Option(False, "--show", help="Print each answer as it is judged (--facts)."),
    collection: str = typer.Option("", help="Collection to ask (default: beir-<folder name>)."),
    limit: int = typer.Option(50, min=1, help="Queries to ask (those with judgments, in id order)."),
    ingest_corpus: bool = typer.Option(
        True, "--ingest/--no-ingest", help="Create the collection and ingest the corpus if it does not exist."
    ),
    pipeline: str = typer.Option("chat-documents", help="Pipeline to ask."),
    distractors: int | None = typer.Option(
        None,
        min=0,
        help="Ingest only the judged documents of the asked queries plus this many others (quick runs).",
    ),
    api_key: str = typer.Option("", help="API key (default: TANDEM_SERVICE_API_KEY)."),
    agent_url: str = typer.Option("", help="Agent service URL (default from settings)."),
    retrieval_url: str = typer.Option("", help="Retrieval service URL (default from settings)."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the summary and answers here."),
) -> None:
    """Ask questions through chat-documents (a BEIR set, invented facts with expected answers, or a
    question set over a collection of real documents); report answer and citation quality and latency."""
    common = load_settings(CommonSettings, check_unknown=False)
    key = api_key or common.service_api_key
    if not key:
        console.print("[bold red]error:[/] give --api-key (or set TANDEM_SERVICE_API_KEY)")
        raise typer.Exit(1)
    if sum(x is not None for x in (beir, facts, questions)) != 1:
        console.print("[bold red]error:[/] give exactly one of --beir DIR, --facts N and --questions FILE")
        raise typer.Exit(2)
    run = _Run(
        agent_url=agent_url or common.url_of("agent"),
        retrieval_url=retrieval_url or common.url_of("retrieval"),
        api_key=key,
        pipeline=pipeline,
        llm=llm or None,
        show=show,
        json_out=json_out,
    )
    if questions is not None:
        _questions_command(questions, collection, run)
    elif facts is not None:
        _facts_command(facts, seed, collection, run)
    else:
        assert beir is not None
        _beir_command(
            beir, collection, run, limit=limit, ingest_corpus=ingest_corpus, distractors=distractors
        )


@dataclass(frozen=True)
class _Run:
    """Where and how a question set is asked, and where its report goes (the options every set shares)."""

    agent_url: str
    retrieval_url: str
    api_key: str
    pipeline: str
    llm: str | None  # the agent's model when None (--beir always asks it)
    show: bool
    json_out: Path | None


def _facts_command(facts: int, seed: int, collection: str, run: _Run) -> None:
    """``--facts N``: asks the invented-facts set, prints its summary (and writes it to --json)."""
    try:
        outcomes = run_facts_eval(
            facts,
            seed,
            agent_url=run.agent_url,
            retrieval_url=run.retrieval_url,
            api_key=run.api_key,
            collection=collection or f"facts-{seed}-{facts}",
            pipeline=run.pipeline,
            llm=run.llm,
            progress=run.show,
        )
    except (httpx.HTTPError, RuntimeError) as exc:
        console.print(f"[bold red]error:[/] {type(exc).__name__}: {exc}")
        raise typer.Exit(1) from None
    fsum = facts_summary(outcomes)
    print_facts_summary(fsum, f"{run.pipeline} on {facts} invented facts (seed {seed})")
    if run.json_out:
        payload = {"summary": fsum, "answers": [o.__dict__ for o in outcomes]}
        run.json_out.write_text(json.dumps(payload, indent=2, default=str))


def _beir_command(
    folder: Path, collection: str, run: _Run, *, limit: int, ingest_corpus: bool, distractors: int | None
) -> None:
    """``--beir DIR``: asks the set's judged queries, prints its summary (and writes it to --json)."""
    try:
        data = load_beir(folder)
    except (FileNotFoundError, ValueError) as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(1) from None
    try:
        report = run_rag_eval(
            data,
            agent_url=run.agent_url,
            retrieval_url=run.retrieval_url,
            api_key=run.api_key,
            collection=collection or f"beir-{folder.resolve().name}".lower(),
            limit=limit,
            do_ingest=ingest_corpus,
            pipeline=run.pipeline,
            distractors=distractors,
        )
    except httpx.HTTPError as exc:
        console.print(f"[bold red]error:[/] {type(exc).__name__}: {exc}")
        raise typer.Exit(1) from None
    summary = report.summary()
    print_summary(summary)
    if run.json_out:
        run.json_out.write_text(
            json.dumps(
                {"summary": summary, "answers": [o.__dict__ for o in report.outcomes]}, indent=2, default=str
            )
        )


__all__ = ["rag_command", "run_facts_eval", "run_facts_evals", "run_questions_eval", "run_rag_eval"]


# -- the invented-facts question set ------------------------------------------------------------


@dataclass
class FactOutcome:
    """One answer to a question about an invented fact, judged against what is known to be true."""

    fact_id: str
    question: str
    expected: str
    answer: str
    stated: bool  # the expected answer string is in the shown answer
    # Citations are those of the done event: each resolves to a source shown to the model
    # (markers naming no source are counted apart, as invalid, and never here).
    right_doc: bool  # a citation names the fact's document
    valid_citation: bool  # at least one citation
    model_marker: bool  # the model itself wrote a valid [n] (kind "cited"), not the server
    model_right_doc: bool  # ... and one of those names the fact's document
    extractive: bool  # the groundedness guard answered from the sources instead
    repeated: bool  # a sentence of the shown answer occurs twice
    groundedness: float | None  # share of the answer's substantive sentences supported by a document
    first_token_s: float | None
    total_s: float
    error: str | None = None


def judge_fact(fact: Any, out: dict[str, Any], documents: list[str]) -> FactOutcome:
    """Per-answer metrics of one ``ask`` result (``documents``: every text of the collection)."""
    from services.agent.grounding import check, repeats_sentence
    from services.cli.factset import states

    done = out.get("done") or {}
    answer = str(out.get("answer") or "")
    cites = list(done.get("citations") or [])
    written = [c for c in cites if c.get("kind", "cited") == "cited"]
    report = check(answer, fact.question, documents)
    return FactOutcome(
        fact_id=fact.fact_id,
        question=fact.question,
        expected=fact.answer,
        answer=answer,
        stated=states(answer, fact.answer),
        right_doc=any(c.get("document_id") == fact.fact_id for c in cites),
        valid_citation=bool(cites),
        model_marker=bool(written),
        model_right_doc=any(c.get("document_id") == fact.fact_id for c in written),
        extractive=done.get("kind") == "extractive",
        repeated=repeats_sentence(answer),
        groundedness=report.share,
        first_token_s=out.get("first"),
        total_s=float(out.get("total") or 0.0),
        error=out.get("error"),
    )


class FactsSummary(TypedDict):
    """An invented-facts run's figures (shares of the answered questions; None when none was)."""

    questions: int
    errors: int
    fact_stated: float | None
    right_document_cited: float | None
    valid_citation: float | None
    model_wrote_marker: float | None
    model_cited_right_document: float | None
    extractive: float | None
    repeated_sentence: float | None
    groundedness_mean: float | None
    first_token_p50_s: float
    first_token_p95_s: float
    total_p50_s: float
    total_p95_s: float


def facts_summary(outcomes: list[FactOutcome]) -> FactsSummary:
    ok = [o for o in outcomes if o.error is None]

    def share(attr: str) -> float | None:
        return sum(1 for o in ok if getattr(o, attr)) / len(ok) if ok else None

    grounded = [o.groundedness for o in ok if o.groundedness is not None]
    firsts = [o.first_token_s for o in ok if o.first_token_s is not None]
    totals = [o.total_s for o in ok]
    return {
        "questions": len(outcomes),
        "errors": len(outcomes) - len(ok),
        "fact_stated": share("stated"),
        "right_document_cited": share("right_doc"),
        "valid_citation": share("valid_citation"),
        "model_wrote_marker": share("model_marker"),
        "model_cited_right_document": share("model_right_doc"),
        "extractive": share("extractive"),
        "repeated_sentence": share("repeated"),
        "groundedness_mean": sum(grounded) / len(grounded) if grounded else None,
        "first_token_p50_s": percentile(firsts, 50),
        "first_token_p95_s": percentile(firsts, 95),
        "total_p50_s": percentile(totals, 50),
        "total_p95_s": percentile(totals, 95),
    }


def run_facts_eval(
    count: int, seed: int, *, pipeline: str = "chat-documents", **where: Any
) -> list[FactOutcome]:
    """Ingests ``count`` invented facts of ``seed`` (unless the collection exists) and asks each
    through ``pipeline``; ``where``: the keyword arguments of ``run_facts_evals``."""
    return run_facts_evals(count, seed, [pipeline], **where)[pipeline]


def run_facts_evals(
    count: int,
    seed: int,
    pipelines: list[str],
    *,
    agent_url: str,
    retrieval_url: str,
    api_key: str,
    collection: str,
    llm: str | None = None,
    timeout: float = 300.0,
    progress: bool = False,
) -> dict[str, list[FactOutcome]]:
    """``run_facts_eval`` through several pipelines, interleaved: each question is asked through
    every pipeline before the next question (the first pipeline in turn), so a load that comes and
    goes on the machine falls on all of them alike and their timings compare."""
    from services.cli.factset import make_facts

    facts = make_facts(count, seed)
    headers = {"Authorization": f"Bearer {api_key}"}
    corpus = {f.fact_id: {"title": f.title, "text": f.text} for f in facts}
    with httpx.Client(base_url=retrieval_url, headers=headers, timeout=timeout) as rc:
        ingest(rc, collection, BeirSet(corpus, {}, {}))
    documents = [f.text for f in facts]
    outcomes: dict[str, list[FactOutcome]] = {p: [] for p in pipelines}
    with httpx.Client(base_url=agent_url, headers=headers, timeout=timeout) as ac:
        for i, fact in enumerate(facts):
            turn = i % len(pipelines)
            for pipeline in pipelines[turn:] + pipelines[:turn]:
                outcome = judge_fact(fact, ask(ac, pipeline, collection, fact.question, llm), documents)
                outcomes[pipeline].append(outcome)
                if progress:
                    mark = ("F" if outcome.stated else "-") + ("D" if outcome.right_doc else "-")
                    mark += ("M" if outcome.model_marker else "-") + ("X " if outcome.extractive else "- ")
                    which = f"{pipeline} " if len(pipelines) > 1 else ""
                    line = f"{i + 1:>3} {which}{mark}{fact.question!r} -> {outcome.answer.strip()[:140]!r}"
                    console.print(line, markup=False, highlight=False, soft_wrap=True)
    return outcomes


def print_facts_summary(summary: FactsSummary, title: str = "chat-documents on invented facts") -> None:
    def pct(v: Any) -> str:
        return "n/a" if v is None else f"{100 * v:.1f}%"

    def sec(v: Any) -> str:
        return "n/a" if v is None else f"{v:.2f}"

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, value in [
        ("questions (errors)", f"{summary['questions']} ({summary['errors']})"),
        ("expected fact stated", pct(summary["fact_stated"])),
        ("right document cited (any kind)", pct(summary["right_document_cited"])),
        (">=1 valid citation (any kind)", pct(summary["valid_citation"])),
        ("model wrote a valid \\[n] itself", pct(summary["model_wrote_marker"])),
        ("... naming the right document", pct(summary["model_cited_right_document"])),
        ("answered extractively by the guard", pct(summary["extractive"])),
        ("a sentence repeated", pct(summary["repeated_sentence"])),
        ("groundedness (mean supported share)", pct(summary["groundedness_mean"])),
        (
            "first token p50 / p95 (s)",
            f"{sec(summary['first_token_p50_s'])} / {sec(summary['first_token_p95_s'])}",
        ),
        ("full answer p50 / p95 (s)", f"{sec(summary['total_p50_s'])} / {sec(summary['total_p95_s'])}"),
    ]:
        table.add_row(label, value)
    console.print(table)


# -- question sets over real documents (services/cli/eval_questions.py) -------------------------


class CollectionNotFound(LookupError):
    pass


def collection_texts(client: httpx.Client, collection: str) -> list[str]:
    """Every document text of ``collection`` (what groundedness is judged against);
    ``CollectionNotFound`` naming it when the retrieval service has no such collection."""
    resp = client.get(f"/v1/collections/{collection}")
    if resp.status_code == 404:
        raise CollectionNotFound(f"collection {collection!r} not found (HTTP 404)")
    resp.raise_for_status()
    texts: list[str] = []
    offset: int | None = 0
    while offset is not None:
        page = client.get(f"/v1/collections/{collection}/documents", params={"limit": 100, "offset": offset})
        page.raise_for_status()
        body = page.json()
        for doc in body.get("documents") or []:
            text = doc.get("text")
            if text is None:
                one = client.get(f"/v1/collections/{collection}/documents/{doc['id']}")
                text = one.json().get("text") if one.status_code == 200 else None
            if text:
                texts.append(str(text))
        offset = body.get("next_offset")
        if offset is None and body.get("documents") and len(texts) < int(body.get("total") or 0):
            offset = int(body["offset"]) + len(body["documents"])
    return texts


def run_questions_eval(
    questions: list[Any],
    *,
    agent_url: str,
    retrieval_url: str,
    api_key: str,
    collection: str,
    pipeline: str = "chat-documents",
    llm: str | None = None,
    timeout: float = 300.0,
    progress: bool = False,
) -> list[Any]:
    """Asks each question of a set over ``collection`` through ``pipeline``; one judged
    ``eval_questions.Outcome`` per question."""
    from services.cli.eval_questions import judge

    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=retrieval_url, headers=headers, timeout=timeout) as rc:
        documents = collection_texts(rc, collection)
    outcomes = []
    with httpx.Client(base_url=agent_url, headers=headers, timeout=timeout) as ac:
        for i, q in enumerate(questions):
            outcome = judge(q, ask(ac, pipeline, collection, q.question, llm), documents)
            outcomes.append(outcome)
            if progress:
                console.print(progress_line(i, outcome), markup=False, highlight=False, soft_wrap=True)
    return outcomes


def progress_line(i: int, o: Any, who: str = "") -> str:
    if o.answerable:
        mark = ("S" if o.stated else "-") + ("D" if o.right_source else "-") + ("P" if o.right_place else "-")
    else:
        mark = "ok " if o.abstained else "ans"
    mark += " A" if o.abstained else f" {o.answer_kind[0].upper()}"
    return f"{i + 1:>3} {who}{o.id:<10} {mark} {o.question!r} -> {o.answer.strip()[:120]!r}"


def print_questions_summary(
    columns: dict[str, dict[str, Any]], title: str, ratio_to: str | None = None
) -> None:
    """One column per answerer (its ``eval_questions.summary``), and ``first / ratio_to`` ratios."""
    from services.cli.eval_questions import METRICS, fmt, ratios

    table = Table(title=title)
    table.add_column("metric")
    for name in columns:
        table.add_column(name, justify="right")
    first = next(iter(columns))
    ratio = ratios(columns[first], columns[ratio_to]) if ratio_to and ratio_to in columns else None
    if ratio is not None:
        table.add_column(f"{first} / {ratio_to}", justify="right")
    table.add_row(
        "questions (answerable / unanswerable, errors)",
        *[
            f"{s['questions']} ({s['answerable']} / {s['unanswerable']}, {s['errors']})"
            for s in columns.values()
        ],
        *([""] if ratio is not None else []),
    )
    for key, label, share in METRICS:
        cells = [fmt(s.get(key), share) for s in columns.values()]
        if ratio is not None:
            r = ratio.get(key)
            cells.append("n/a" if r is None else f"{r:.2f}x")
        table.add_row(label, *cells)
    # Wide enough for a column per answerer when the output is a file or a pipe.
    out = console if console.is_terminal else Console(width=max(100, 40 + 24 * (len(columns) + 1)))
    out.print(table)


def _questions_command(path: Path, collection: str, run: _Run) -> None:
    from services.cli.eval_questions import QuestionSetError, load_questions, summary

    if not collection:
        console.print(
            "[bold red]error:[/] --questions needs --collection NAME (a collection of its documents)"
        )
        raise typer.Exit(2)
    try:
        qs = load_questions(path)
    except QuestionSetError as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        raise typer.Exit(2) from None
    try:
        outcomes = run_questions_eval(
            qs,
            agent_url=run.agent_url,
            retrieval_url=run.retrieval_url,
            api_key=run.api_key,
            collection=collection,
            pipeline=run.pipeline,
            llm=run.llm,
            progress=run.show,
        )
    except CollectionNotFound as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        raise typer.Exit(1) from None
    except httpx.HTTPError as exc:
        console.print(f"[bold red]error:[/] {type(exc).__name__}: {exc}")
        raise typer.Exit(1) from None
    result = summary(outcomes)
    print_questions_summary(
        {run.pipeline: result}, f"{run.pipeline} on {path.name} over collection {collection!r}"
    )
    if run.json_out:
        payload = {"summary": result, "answers": [o.to_dict() for o in outcomes]}
        run.json_out.write_text(json.dumps(payload, indent=2, default=str))
