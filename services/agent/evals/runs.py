"""Evaluation runs: a set's questions answered through a pipeline, judged, added up and compared.

A run answers each question of the set with ``PipelineAnswers.answer_unrecorded`` (no turn record,
no memory, no quality metric: an evaluation is not traffic), as a chat turn of the tenant would
get it with the run's ``llm`` and ``reader``, a few at a time, in the background of the replica
that took the request; its record in Redis carries the progress and a heartbeat, so a run whose
replica died is reported failed instead of running forever.

``regression_check`` answers a tenant's regression sets with two answerers (a candidate and what
it would replace) for a gate that decides on the outcome.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Literal

from services.agent.clients import ChatRequest, InferenceClient
from services.agent.config import AgentSettings
from services.agent.evals.judge import (
    Answered,
    cosine,
    judge_messages,
    read_verdict,
    score,
    totals,
    totals_by_kind,
)
from services.agent.evals.protocol import (
    ChangedQuestion,
    EvalQuestion,
    EvalResult,
    EvalRun,
    EvalRunCreate,
    EvalSet,
    JudgeVerdict,
    MetricDifference,
    Progress,
    RegressionReport,
    RegressionSetReport,
    RunComparison,
)
from services.agent.evals.store import EvalStore, new_id
from services.agent.model_access import CallerModels
from services.agent.model_choice import PromotionStore
from services.agent.pipeline_answers import PipelineAnswers
from services.agent.protocol import ReaderChoice
from services.common.auth import Principal
from services.common.errors import InvalidRequest, NotFound, PayloadTooLarge, TandemError

if TYPE_CHECKING:
    from services.agent.pipelines.state import RunState

log = logging.getLogger(__name__)

DEFAULT_PIPELINE = "chat-documents-generate"
# A run not heard from for this long (no question finished) was interrupted with its replica.
STALE_S = 900.0

# An answerer of one question over a collection (a pipeline with a model and a reader).
Runner = Callable[[EvalQuestion, str], Awaitable[Answered]]
Clock = Callable[[], float]


def guard_replaced(state: RunState) -> bool:
    """The groundedness guard judged what the model wrote degenerate and showed source sentences
    instead (its ``extractive`` answer): what is shown is then the guard's, not the model's."""
    return (
        state.answer_kind == "extractive"
        and state.grounding is not None
        and state.grounding not in ("ok", "partial")
    )


def answered_of(state: RunState, seconds: float, written: bool = False) -> Answered:
    """The shown answer; with ``written``, what the model wrote where the guard replaced it, with
    no citation and no supported sentence (the guard found none worth showing), so a gate
    judges the model and not the guard's fallback."""
    if written and guard_replaced(state):
        return Answered(
            answer=state.completion,
            answer_kind="generated",
            documents=[c.text for c in state.chunks],
            groundedness=0.0,
            latency_seconds=seconds,
            model=state.model,
        )
    return Answered(
        answer=state.answer,
        citations=[c.to_dict() for c in state.citations],
        answer_kind=state.answer_kind,
        documents=[c.text for c in state.chunks],
        groundedness=state.groundedness,
        latency_seconds=seconds,
        model=state.model,
    )


def pipeline_runner(
    answers: PipelineAnswers,
    key: str,
    pipeline: str,
    llm: str | None,
    reader: ReaderChoice | None,
    timer: Clock = time.perf_counter,
    *,
    written: bool = False,
) -> Runner:
    """``pipeline`` answering as a chat turn with ``llm`` (None: the served default) and
    ``reader`` would, with ``key``'s rights; a failure is the question's error, not the run's.
    ``written``: judge what the model wrote (``answered_of``), as a gate on a model does."""

    async def run(q: EvalQuestion, collection: str) -> Answered:
        start = timer()
        try:
            state = await answers.answer_unrecorded(key, pipeline, q.question, collection, llm, reader)
        except TandemError as exc:
            return Answered(answer="", error=exc.message, latency_seconds=timer() - start)
        return answered_of(state, timer() - start, written)

    return run


async def answer_all(
    questions: Sequence[EvalQuestion],
    collection: str,
    runner: Runner,
    concurrency: int,
    on_done: Callable[[int, EvalResult], Awaitable[None]] | None = None,
) -> list[tuple[EvalResult, Answered]]:
    """Each question answered and judged (in the set's order), ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(n: int, q: EvalQuestion) -> tuple[EvalResult, Answered]:
        async with gate:
            out = await runner(q, collection)
            result = score(q, n, out)
            if on_done is not None:
                await on_done(n, result)
            return result, out

    return list(await asyncio.gather(*(one(n, q) for n, q in enumerate(questions, 1))))


# -- optional verdicts: embedding similarity and a judge model --------------------------------


async def add_similarity(
    inference: InferenceClient, model: str, questions: Sequence[EvalQuestion], results: list[EvalResult]
) -> None:
    """Each answer's cosine to its reference (or key phrases) under ``model``."""
    for q, r in zip(questions, results, strict=True):
        expected = q.reference or " ".join(q.answers or [])
        if not q.answerable or r.error or not r.answer.strip() or not expected.strip():
            continue
        try:
            u, v = await inference.embed(model, [r.answer, expected])
        except TandemError as exc:
            log.info("evaluation: no similarity for %r: %s", q.question[:80], exc.message)
            continue
        sim = cosine(u, v)
        r.similarity = None if sim is None else round(sim, 4)


async def judge_verdict(client: InferenceClient, model: str, q: EvalQuestion, answer: str) -> JudgeVerdict:
    request = ChatRequest(model=model, messages=judge_messages(q, answer), max_tokens=128, temperature=0.0)
    try:
        reply = await client.complete(request)
    except TandemError as exc:
        return JudgeVerdict(model=model, verdict="unclear", reason=f"the judge failed: {exc.message}")
    return read_verdict(model, reply.message.content or "")


# -- the service behind /v1/evals -------------------------------------------------------------


class Evaluations:
    """Sets and runs of the agent's tenants, kept in ``store``; runs go on in tasks of this
    process, answered by ``answers`` with the models ``models`` checks and the tenant's choice
    in ``promotions``."""

    def __init__(
        self,
        settings: AgentSettings,
        store: EvalStore,
        answers: PipelineAnswers,
        promotions: PromotionStore,
        clock: Clock = time.time,
    ) -> None:
        self.settings = settings
        self.store = store
        self.answers = answers
        self.upstreams = answers.upstreams
        self.models = answers.models
        self.promotions = promotions
        self.clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def limit_check(self, count: int) -> None:
        limit = self.settings.eval_max_questions
        if count > limit:
            raise PayloadTooLarge(
                f"the set would hold {count} questions; a set holds at most {limit} "
                "(TANDEM_AGENT_EVAL_MAX_QUESTIONS)",
                param="questions",
                code="set_too_large",
            )

    def judge_client(self, key: str) -> InferenceClient:
        url = self.settings.eval_judge_url
        if url:
            return InferenceClient(url, self.settings.eval_judge_api_key, self.settings.upstream_timeout_s)
        return self.upstreams.inference(key)

    async def start(self, principal: Principal, key: str, body: EvalRunCreate) -> EvalRun:
        tenant = principal.tenant
        eval_set = await self.store.get_set(tenant, body.set)
        if not eval_set.questions:
            raise InvalidRequest(f"the evaluation set {eval_set.id!r} has no questions", param="set")
        name = body.pipeline or DEFAULT_PIPELINE
        pipeline = self.answers.pipelines.get(name)
        if pipeline is None or pipeline.spec.kind != "chat":
            chat = ", ".join(p for p, v in self.answers.pipelines.items() if v.spec.kind == "chat")
            raise NotFound(f"unknown chat pipeline {name!r} (known: {chat})", param="pipeline")
        inference = self.upstreams.inference(key)
        if body.llm:
            await self.models.check(inference, body.llm)
        if body.reader and body.reader != self.settings.reader:
            readers = {m.id for m in await inference.models() if m.kind == "rerank"}
            if body.reader not in readers:
                raise NotFound(f"unknown reader {body.reader!r} for this key", param="reader")
        if body.judge_model and not self.settings.eval_judge_url:
            # the judge answers on the tenant's inference service: it must be one of its models
            await self.models.check(inference, body.judge_model)
        # a named model is checked like a chat turn's; the tenant's own default and reader only
        # where the caller may be served them (else the earlier ones it may)
        models = CallerModels(self.promotions.restrictions, principal)
        if body.llm:
            await models.check_named(body.llm)
        choice = await self.promotions.choice(tenant)
        run_id = new_id("evrun")
        # an evaluation measures the default itself, never the canary
        as_default = choice.model_copy(update={"canary": None})
        default = await models.default(as_default, run_id) if not body.llm else None
        tenant_reader = await models.reader(choice) if not body.reader else None
        now = self.clock()
        run = EvalRun(
            id=run_id,
            set=eval_set.id,
            set_name=eval_set.name,
            collection=eval_set.collection,
            pipeline=name,
            llm=body.llm or default,
            reader=body.reader or (tenant_reader.name if tenant_reader else None),
            judge_model=body.judge_model,
            progress=Progress(total=len(eval_set.questions)),
            created_at=now,
            heartbeat_at=now,
        )
        await self.store.put_run(tenant, run, keep=self.settings.eval_max_runs)
        reader = ReaderChoice(name=body.reader) if body.reader else tenant_reader
        runner = pipeline_runner(self.answers, key, name, run.llm, reader)
        task = asyncio.create_task(self._run(tenant, key, run, eval_set, runner, body.similarity))
        self._tasks[run.id] = task
        task.add_done_callback(lambda _: self._tasks.pop(run.id, None))
        return run

    async def _run(
        self, tenant: str, key: str, run: EvalRun, eval_set: EvalSet, runner: Runner, similarity: bool
    ) -> None:
        run.status, run.started_at = "running", self.clock()
        await self._save(tenant, run)
        done: dict[int, EvalResult] = {}

        async def progress(n: int, result: EvalResult) -> None:
            done[n] = result
            run.progress.done = len(done)
            run.results = [done[i] for i in sorted(done)]
            await self._save(tenant, run)

        try:
            pairs = await answer_all(
                eval_set.questions, eval_set.collection, runner, self.settings.eval_concurrency, progress
            )
            results = [r for r, _ in pairs]
            if run.llm is None:
                run.llm = next((a.model for _, a in pairs if a.model), None)
            if similarity:
                inference = self.upstreams.inference(key)
                model = await self.upstreams.retrieval(key).embedding_model(eval_set.collection)
                await add_similarity(inference, model, eval_set.questions, results)
            if run.judge_model:
                client = self.judge_client(key)
                for q, r in zip(eval_set.questions, results, strict=True):
                    if r.error is None:
                        r.judge = await judge_verdict(client, run.judge_model, q, r.answer)
            run.results = results
            run.totals, run.totals_by_kind = totals(results), totals_by_kind(results)
            run.status = "succeeded"
        except asyncio.CancelledError:
            run.status, run.error = "cancelled", "the agent stopped during the run"
            await asyncio.shield(self._save(tenant, run, finished=True))
            raise
        except Exception as exc:  # a run's failure is its record's, never the replica's
            log.exception("evaluation run %s failed", run.id)
            run.status = "failed"
            run.error = exc.message if isinstance(exc, TandemError) else f"{type(exc).__name__}: {exc}"
        await self._save(tenant, run, finished=True)

    async def _save(self, tenant: str, run: EvalRun, finished: bool = False) -> None:
        run.heartbeat_at = self.clock()
        if finished:
            run.finished_at = run.heartbeat_at
        await self.store.put_run(tenant, run)

    async def run(self, tenant: str, run_id: str) -> EvalRun:
        run = await self.store.get_run(tenant, run_id)
        live = run.status in ("queued", "running") and run.id not in self._tasks
        if live and (run.heartbeat_at or run.created_at) < self.clock() - STALE_S:
            run.status, run.error = "failed", "interrupted: the agent replica running it stopped"
            run.finished_at = self.clock()
            await self.store.put_run(tenant, run)
        return run

    async def wait(self, run_id: str) -> None:
        """Until this process's run ``run_id`` ends (tests and the CLI in-process)."""
        task = self._tasks.get(run_id)
        if task is not None:
            await asyncio.wait([task])

    def cancel(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()


# -- comparing two runs ------------------------------------------------------------------------

# metric -> (the result's value for it, or None where it does not apply)
_PER_QUESTION: dict[str, Callable[[EvalResult], float | None]] = {
    "stated": lambda r: None if r.stated is None else float(r.stated),
    "right_source": lambda r: None if r.right_source is None else float(r.right_source),
    "right_page": lambda r: None if r.right_page is None else float(r.right_page),
    "not_found": lambda r: None if r.answerable else float(r.abstained),
    "false_not_found": lambda r: float(r.abstained) if r.answerable else None,
    "grounded": lambda r: r.grounded,
    "overlap": lambda r: r.overlap,
    "similarity": lambda r: r.similarity,
    "judged_correct": lambda r: (
        None if r.judge is None or r.judge.verdict == "unclear" else float(r.judge.verdict == "correct")
    ),
}
HEADLINE = "stated"
BOOTSTRAP_SAMPLES = 400


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def paired_se(d: Sequence[float]) -> float | None:
    """The standard error of the mean paired difference, sqrt(var(d) / n) (sample variance)."""
    n = len(d)
    if n < 2:
        return None
    m = _mean(d)
    return math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1) / n)


def difference(a: float | None, b: float | None, se: float | None, n: int) -> MetricDifference:
    """``b - a``, whether it is beyond about 2 SE, and if not, the questions that would show a
    difference this size at 2 SE (the SE falls as 1/sqrt(n))."""
    diff = None if a is None or b is None else b - a
    out = MetricDifference(a=a, b=b, difference=diff, se=se)
    if diff is None or se is None:
        return out
    out.enough = diff != 0 and abs(diff) >= 2 * se
    if not out.enough and diff != 0:
        # less a hair: float noise must not ask for one question more than the exact figure
        out.questions_needed = math.ceil(n * (2 * se / abs(diff)) ** 2 - 1e-9)
    return out


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(0.5 * (len(s) - 1))))]


def _median_difference_se(a: Sequence[float], b: Sequence[float]) -> float | None:
    """The SE of the difference of medians of paired latencies, by a bootstrap over questions
    (seeded: the same runs always compare the same)."""
    n = len(a)
    if n < 2:
        return None
    rng = random.Random(0)
    diffs = []
    for _ in range(BOOTSTRAP_SAMPLES):
        pick = [rng.randrange(n) for _ in range(n)]
        diffs.append(_median([b[i] for i in pick]) - _median([a[i] for i in pick]))
    m = _mean(diffs)
    return math.sqrt(sum((x - m) ** 2 for x in diffs) / (len(diffs) - 1))


def paired_difference(pairs: Sequence[tuple[float | None, float | None]]) -> MetricDifference:
    """Per-question values ``(a, b)``: over the questions both have one, both means, ``b - a``
    and its paired standard error (``difference``)."""
    known = [(x, y) for x, y in pairs if x is not None and y is not None]
    if not known:
        return MetricDifference(a=None, b=None, difference=None, se=None)
    xs, ys = [x for x, _ in known], [y for _, y in known]
    return difference(_mean(xs), _mean(ys), paired_se([y - x for x, y in known]), len(known))


def compare_results(
    a_id: str, a_results: Sequence[EvalResult], b_id: str, b_results: Sequence[EvalResult]
) -> RunComparison:
    """Two runs' results paired by question id: which ``b`` fixed or broke (a right answer is the
    expected one stated, or "not found" where the documents do not say), how many stayed, and
    each metric's difference with its paired standard error."""
    by_id = {r.id: r for r in a_results}
    pairs = [(by_id[r.id], r) for r in b_results if r.id in by_id]
    fixed: list[ChangedQuestion] = []
    broken: list[ChangedQuestion] = []
    same = 0
    for ra, rb in pairs:
        if ra.right == rb.right:
            same += 1
            continue
        changed = ChangedQuestion(n=rb.n, id=rb.id, question=rb.question, a=ra, b=rb)
        (fixed if rb.right else broken).append(changed)
    answered = [(ra, rb) for ra, rb in pairs if ra.error is None and rb.error is None]
    totals_ = {
        metric: paired_difference([(value(ra), value(rb)) for ra, rb in answered])
        for metric, value in _PER_QUESTION.items()
    }
    if answered:
        ta, tb = [ra.latency_seconds for ra, _ in answered], [rb.latency_seconds for _, rb in answered]
        se = _median_difference_se(ta, tb)
        totals_["p50_seconds"] = difference(_median(ta), _median(tb), se, len(answered))
    head = totals_[HEADLINE]
    return RunComparison(
        a=a_id,
        b=b_id,
        questions=len(pairs),
        fixed=fixed,
        broken=broken,
        same=same,
        totals=totals_,
        enough=head.enough,
        questions_needed=head.questions_needed,
    )


def compare(a: EvalRun, b: EvalRun) -> RunComparison:
    """``compare_results`` of two runs."""
    return compare_results(a.id, a.results, b.id, b.results)


# -- a gate's rule: a loss counts when it is beyond the margin and beyond its sampling error ----

Loss = Literal["worse", "too_few"]


def judged_loss(d: MetricDifference, margin: float, lower_is_better: bool = False) -> Loss | None:
    """Whether ``b`` (a candidate) loses to ``a`` (what it would replace) on one metric.

    ``"worse"``: the loss exceeds ``margin`` and is at least twice its paired standard error, so
    an equal candidate shows one that large by chance about once in 40 (one-sided). ``"too_few"``:
    it exceeds the margin but not 2 SE (or one question leaves no SE): too few questions to tell
    it from chance; ``d.questions_needed`` says how many would. None: within the margin."""
    if d.difference is None:
        return None
    drop = d.difference if lower_is_better else -d.difference
    if drop <= margin:
        return None
    return "worse" if d.enough else "too_few"


def loss_text(metric: str, d: MetricDifference, lower_is_better: bool = False) -> str:
    """``"cited 0.40 < 0.60"`` (candidate first), with the SE and the questions needed where the
    loss is not beyond 2 SE."""
    assert d.a is not None and d.b is not None
    text = f"{metric} {d.b:.2f} {'>' if lower_is_better else '<'} {d.a:.2f}"
    if d.enough:
        return text
    if d.se is None:
        return f"{text} (one question: no standard error)"
    return f"{text} (SE {d.se:.2f}; about {d.questions_needed} questions would tell)"


# -- regression sets, for a gate ----------------------------------------------------------------

# Metrics a candidate must not lose by more than the margin; false_not_found must not grow by it.
HIGHER_IS_BETTER = ("stated", "right_source", "right_page", "not_found", "grounded")
LOWER_IS_BETTER = ("false_not_found",)
# Broken questions named in a report's reason (all of them are in its sets' ``broken``).
REASON_QUESTIONS = 10


def regression_set_report(
    eval_set: EvalSet, current: Sequence[EvalResult], candidate: Sequence[EvalResult], margin: float
) -> RegressionSetReport:
    """One regression set's two runs judged by ``judged_loss``, with the questions that broke."""
    cmp = compare_results("current", current, "candidate", candidate)
    worse: list[str] = []
    too_few: list[str] = []
    for metric in (*HIGHER_IS_BETTER, *LOWER_IS_BETTER):
        d, lower = cmp.totals[metric], metric in LOWER_IS_BETTER
        loss = judged_loss(d, margin, lower)
        if loss is not None:
            (worse if loss == "worse" else too_few).append(loss_text(metric, d, lower))
    return RegressionSetReport(
        set=eval_set.id,
        name=eval_set.name,
        questions=len(eval_set.questions),
        candidate=totals(candidate),
        current=totals(current),
        totals={m: cmp.totals[m] for m in (*HIGHER_IS_BETTER, *LOWER_IS_BETTER)},
        worse=worse,
        too_few=too_few,
        broken=cmp.broken,
        fixed=len(cmp.fixed),
    )


def _broken_text(reports: Sequence[RegressionSetReport]) -> str:
    named = [(r.name, c.question) for r in reports for c in r.broken]
    shown = "; ".join(f"{name}: {question!r}" for name, question in named[:REASON_QUESTIONS])
    more = len(named) - REASON_QUESTIONS
    return shown + (f" and {more} more" if more > 0 else "")


async def regression_check(
    tenant: str,
    candidate_runner: Runner,
    current_runner: Runner,
    margin: float,
    *,
    store: EvalStore,
    concurrency: int = 2,
) -> RegressionReport:
    """The tenant's regression sets (``"regression": true``) answered by the candidate and by what
    it would replace (each a ``Runner``, e.g. ``pipeline_runner``), judged alike; it fails when
    any metric of any set is worse by ``judged_loss``, and names the questions that broke."""
    reports = []
    for s in await store.sets(tenant):
        if not s.regression or not s.questions:
            continue
        new = [r for r, _ in await answer_all(s.questions, s.collection, candidate_runner, concurrency)]
        old = [r for r, _ in await answer_all(s.questions, s.collection, current_runner, concurrency)]
        reports.append(regression_set_report(s, old, new, margin))
    if not reports:
        return RegressionReport(
            passed=True, reason="the tenant has no regression set: nothing more to check", sets=[]
        )
    losses = [f"{r.name}: {', '.join(r.worse)}" for r in reports if r.worse]
    broken = _broken_text(reports)
    if losses:
        reason = f"worse by more than {margin:.2f} and 2 SE on " + "; ".join(losses)
        reason += f"; broken: {broken}" if broken else ""
        return RegressionReport(passed=False, reason=reason, sets=reports)
    counts = ", ".join(f"{r.questions} in {r.name}" for r in reports)
    reason = f"not worse by more than {margin:.2f} on any metric ({counts})"
    unsure = [f"{r.name}: {', '.join(r.too_few)}" for r in reports if r.too_few]
    if unsure:
        reason += "; too few questions to tell on " + "; ".join(unsure)
    if broken:
        reason += f"; broken: {broken}"
    return RegressionReport(passed=True, reason=reason, sets=reports)
