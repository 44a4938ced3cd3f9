"""Feedback on answers, drafts and preference pairs, and datasets built from them (issue 13).

``/v1/feedback`` (rate, correct, list, delete, stats), ``/v1/messages/{id}`` (the turn
record; ``/regenerate`` a new draft; ``/choose`` one draft over another) and
``/v1/feedback/datasets`` / ``/v1/feedback/train`` (rows for the trainer, and a job).
Everything is scoped to the caller's tenant: another tenant's message is a 404. A member key
sees, rates, corrects and builds datasets from only the answers it asked for (another key's
message is a 404 too); an admin key sees all of the tenant's, lists who gave feedback
(``/v1/feedback/contributors``) and alone trains on it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel

from services.agent.api.common import event_stream
from services.agent.api.deps import CallerDep, PrincipalDep, RuntimeDep
from services.agent.clients import InferenceClient, JobBody
from services.agent.feedback import (
    JOB_TYPE,
    BuiltDataset,
    Capped,
    build_dataset,
    cap_per_key,
    check_enough,
    feedback_object,
)
from services.agent.model_choice import held_out
from services.agent.protocol import (
    Choice,
    ChooseRequest,
    Contributor,
    ContributorList,
    DatasetFormat,
    DatasetRequest,
    DatasetResult,
    Feedback,
    FeedbackCreate,
    FeedbackList,
    FeedbackStats,
    ModelStats,
    Promotion,
    ReaderTraining,
    RegenerateRequest,
    TrainRequest,
    TrainResult,
    TurnRecord,
)
from services.agent.reader.features import FEATURES_READER
from services.agent.reader.feedback_rows import ReaderDataset, reader_dataset, rows_from_feedback
from services.agent.runtime import AgentRuntime, TurnResult, collect, peek
from services.agent.turns import FeedbackFilter, FeedbackRow, owner_scope
from services.common.app_factory import JSON_OR_SSE
from services.common.audit import audit_request
from services.common.auth import Principal, key_names, require_admin
from services.common.bounds import MAX_UNIX_S, NAME_CHARS
from services.common.errors import InvalidRequest, NotFound, TandemError
from services.common.idempotency import RESPONSES as IDEMPOTENCY_RESPONSES
from services.common.idempotency import idempotent

log = logging.getLogger(__name__)

# Reader rows "train on feedback" needs before it trains the tenant's reader, of each label.
READER_MIN_ROWS = 8
READER_MIN_PER_LABEL = 2

router = APIRouter(tags=["feedback"], responses={404: {"description": "no such message or feedback"}})


@router.post(
    "/v1/feedback",
    response_model=Feedback,
    responses={
        400: {"description": "invalid feedback (the message names the field and value)"},
        401: {"description": "missing or unknown API key"},
        404: {"description": "no such message"},
        **IDEMPOTENCY_RESPONSES,
    },
)
async def post_feedback(
    body: FeedbackCreate, request: Request, runtime: RuntimeDep, principal: PrincipalDep
) -> Any:
    """Record feedback; with an ``Idempotency-Key`` header a retry returns the first answer."""

    async def create() -> tuple[int, Any]:
        return 200, (await runtime.feedback.give(principal, body)).model_dump(mode="json")

    return await idempotent(request, principal.tenant, create)


@router.get("/v1/feedback", response_model=FeedbackList)
async def list_feedback(
    runtime: RuntimeDep,
    principal: PrincipalDep,
    since: float | None = Query(
        None, ge=0, le=MAX_UNIX_S, description="feedback given or changed at or after (unix seconds)"
    ),
    pipeline: str | None = Query(None, max_length=NAME_CHARS),
    model: str | None = Query(None, max_length=NAME_CHARS),
    rating: int | None = Query(None, ge=-1, le=1, description="1 or -1"),
    limit: int = Query(50, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=2**63 - 1),  # SQLite integers are 64-bit
) -> FeedbackList:
    # Not Literal[1, -1]: a query string's "-1" is text, which a Literal of ints refuses.
    if rating is not None and rating not in (1, -1):
        raise InvalidRequest(f"rating: must be 1 or -1 (got {rating})", param="rating")
    filt = FeedbackFilter(
        since=since, pipeline=pipeline, model=model, rating=rating, owner=owner_scope(principal)
    )
    rows, total = await runtime.turns.list_feedback(principal.tenant, filt, limit, offset)
    return FeedbackList(
        data=[feedback_object(fb, rec) for fb, rec in rows], total=total, has_more=offset + len(rows) < total
    )


@router.get("/v1/feedback/stats", response_model=FeedbackStats)
async def feedback_stats(runtime: RuntimeDep, principal: PrincipalDep) -> FeedbackStats:
    stats = await runtime.turns.stats(principal.tenant, owner_scope(principal))
    return FeedbackStats(data=[ModelStats(**s) for s in stats])


@router.get(
    "/v1/feedback/contributors",
    response_model=ContributorList,
    responses={403: {"description": "a member key (only an admin key sees who gave what)"}},
)
async def feedback_contributors(runtime: RuntimeDep, principal: PrincipalDep) -> ContributorList:
    """The tenant's feedback per key that gave it (newest first): what to leave out of a training
    set with ``exclude_keys`` when one key's feedback looks wrong."""
    require_admin(principal, "GET /v1/feedback/contributors")
    cap = runtime.settings.feedback_rows_per_key
    rows = await runtime.turns.contributors(principal.tenant)
    names = await key_names(runtime.memory.r, [r["key_id"] for r in rows])
    return ContributorList(
        per_key_cap=cap,
        data=[
            Contributor(
                **r,
                name=names.get(r["key_id"]),
                counted=min(cap, r["ratings"] + r["preferences"]),
            )
            for r in rows
        ],
    )


class FeedbackDeleted(BaseModel):
    message_id: str
    deleted: bool


@router.delete("/v1/feedback/{message_id}")
async def delete_feedback(message_id: str, runtime: RuntimeDep, principal: PrincipalDep) -> FeedbackDeleted:
    if not await runtime.turns.delete_feedback(principal.tenant, message_id, owner_scope(principal)):
        raise NotFound(f"no feedback on message {message_id!r}", param="message_id")
    return FeedbackDeleted(message_id=message_id, deleted=True)


@router.get("/v1/messages/{message_id}", response_model=TurnRecord)
async def get_message(message_id: str, runtime: RuntimeDep, principal: PrincipalDep) -> TurnRecord:
    return await runtime.feedback.turn_of(principal, message_id, "message_id")


@router.post("/v1/messages/{message_id}/regenerate", response_model=None, responses=JSON_OR_SSE)
async def regenerate(
    message_id: str, runtime: RuntimeDep, who: CallerDep, body: RegenerateRequest | None = None
) -> Any:
    principal, key = who
    result = TurnResult()
    events = runtime.regenerate(principal, key, message_id, result)
    if body is None or not body.stream:
        await collect(events)
        return {
            "message_id": result.message_id,
            "draft_of": result.draft_of,
            "answer": result.answer,
            "citations": result.citations,
            "model": result.model,
            "finish_reason": result.finish_reason,
            "conversation_id": result.conversation_id,
        }
    return event_stream(*await peek(events))


@router.post("/v1/messages/{message_id}/choose", response_model=Choice)
async def choose_draft(
    message_id: str, body: ChooseRequest, runtime: RuntimeDep, principal: PrincipalDep
) -> Choice:
    return await runtime.feedback.choose(principal, message_id, body.over)


# -- datasets and training -------------------------------------------------------------------


def _min_rows(runtime: AgentRuntime, fmt: str) -> int:
    return int(getattr(runtime.settings, f"dataset_min_rows_{fmt}"))


def _filter(principal: Principal, req: DatasetRequest | TrainRequest) -> FeedbackFilter:
    """A member's datasets hold its own answers only; an admin's the tenant's."""
    return FeedbackFilter(
        since=req.since,
        pipeline=req.pipeline,
        model=req.model,
        owner=owner_scope(principal),
        exclude_keys=frozenset(req.exclude_keys),
    )


async def _feedback(
    runtime: AgentRuntime, principal: Principal, req: DatasetRequest | TrainRequest
) -> Capped:
    """The feedback a training set draws on: filtered, and each key's first
    ``feedback_rows_per_key`` ratings and choices (choices count toward the cap whatever the
    format, as they do when the feedback is given)."""
    filt = _filter(principal, req)
    rated, _ = await runtime.turns.list_feedback(principal.tenant, filt)
    prefs = await runtime.turns.preferences(principal.tenant, filt)
    return cap_per_key(rated, prefs, runtime.settings.feedback_rows_per_key)


async def _build(
    runtime: AgentRuntime,
    principal: Principal,
    req: DatasetRequest | TrainRequest,
    fmt: DatasetFormat,
    holdout: float = 0.0,
) -> BuiltDataset:
    """With ``holdout``, the regression set is kept out, unless what remains is too little to
    train on: then nothing is held out (the gate compares on recent questions alone)."""
    filt = _filter(principal, req)
    given = await _feedback(runtime, principal, req)
    rated, prefs = given.feedback, given.preferences if fmt == "dpo" else []
    built = build_dataset(fmt, rated, prefs, holdout)
    try:
        check_enough(built, _min_rows(runtime, fmt), filt)
    except InvalidRequest:
        if not built.held_out:
            raise
        built = build_dataset(fmt, rated, prefs, 0.0)
        check_enough(built, _min_rows(runtime, fmt), filt)
        built.counts["held_out"] = 0
    built.cap, built.over_cap, built.excluded_keys = given.cap, given.over_cap, sorted(filt.exclude_keys)
    return built


async def _auto_format(runtime: AgentRuntime, principal: Principal, req: TrainRequest) -> DatasetFormat:
    """``kto`` where the feedback holds at least as many thumbs up as corrections; ``dpo`` (each
    correction chosen over the answer it corrects) where corrections outnumber them. Measured with
    ``benchmarks.loop``: on feedback rich in thumbs up KTO taught the marker and the facts (model-
    written [n] 10% -> 97%, facts 59% -> 77%); on feedback of thumbs down and corrections KTO lost
    the facts (53% -> 20%), SFT on the corrections barely moved the model, DPO moved the marker
    without losing facts (benchmarks/RESULTS.md, "the loop")."""
    rated = (await _feedback(runtime, principal, req)).feedback
    corrections = sum(bool((fb.correction or "").strip()) for fb, _ in rated)
    ups = sum(fb.rating == 1 and not (fb.correction or "").strip() for fb, _ in rated)
    if corrections > ups and corrections >= _min_rows(runtime, "dpo"):
        return "dpo"
    return "kto"


async def _upload(runtime: AgentRuntime, key: str, built: BuiltDataset) -> DatasetResult:
    name = f"feedback-{built.format}-{int(time.time())}.jsonl"
    stored = await runtime.upstreams.trainer(key).upload_file(name, built.jsonl())
    return DatasetResult(
        file_id=str(stored["id"]),
        format=built.format,
        rows=len(built.rows),
        counts=built.counts,
        contributors=built.contributors(),
        per_key_cap=built.cap,
        over_cap=built.over_cap,
        excluded_keys=built.excluded_keys,
        left_out=built.left_out(),
        collections=sorted(built.collections),
    )


@router.post("/v1/feedback/datasets", response_model=DatasetResult)
async def build_feedback_dataset(body: DatasetRequest, runtime: RuntimeDep, who: CallerDep) -> DatasetResult:
    return await _upload(runtime, who.key, await _build(runtime, who.principal, body, body.format))


@router.post("/v1/feedback/train", response_model=TrainResult)
async def train_on_feedback(
    body: TrainRequest, request: Request, runtime: RuntimeDep, who: CallerDep
) -> TrainResult:
    """Builds the dataset and starts a LoRA job (defaults, published) on the model that wrote the
    answers: the tenant's model, so only an admin key may."""
    principal, key = who
    require_admin(principal, "POST /v1/feedback/train")
    if body.format == "pairs":
        # an embedder job starts from an embedder, which the answers do not name
        raise InvalidRequest(
            "format: 'pairs' builds an embedder dataset; build it with POST /v1/feedback/datasets and start "
            "an embedder job on the trainer with its file_id (and the collection, to check its documents)",
            param="format",
        )
    fmt: DatasetFormat = (
        await _auto_format(runtime, principal, body) if body.format == "auto" else body.format
    )
    built = await _build(runtime, principal, body, fmt, runtime.settings.promotion_holdout)
    if len(built.models) > 1:
        raise InvalidRequest(
            f"model: the feedback is on answers of several models ({', '.join(sorted(built.models))}); "
            "name the one to train with 'model'",
            param="model",
        )
    [base_model] = built.models
    dataset = await _upload(runtime, key, built)
    job_body: JobBody = {
        "type": JOB_TYPE[fmt],
        "base_model": base_model,
        "dataset": dataset.file_id,
        "lora": {},
        "publish": True,
    }
    if body.eval_fraction is not None:
        job_body["eval_fraction"] = body.eval_fraction
    if body.hyperparameters:
        job_body["hyperparameters"] = body.hyperparameters
    job = await runtime.upstreams.trainer(key).create_job(job_body)
    # The gate evaluates the adapter once it is published (services/agent/promotions.py).
    promotion = Promotion(
        job_id=str(job["id"]),
        replaces=(await runtime.promotions.choice(principal.tenant)).default or "",
        status="training",
        margin=runtime.settings.promotion_margin,
        holdout=built.held_out,
        created_at=time.time(),
        collections=dataset.collections,
        left_out=dataset.left_out,
    )
    await runtime.promotions.save(principal.tenant, promotion)
    reader = await _train_reader(runtime, principal, key, body)
    await audit_request(
        request,
        "training.start",
        str(job["id"]),
        {
            "format": fmt,
            "base_model": base_model,
            "rows": dataset.rows,
            "collections": dataset.collections,
            "left_out": {f"{o.reason}:{o.contributor}": o.ratings_and_choices for o in dataset.left_out},
        },
    )
    return TrainResult(dataset=dataset, job=job, promotion=promotion, reader=reader)


def _reader_rows(rated: list[tuple[FeedbackRow, TurnRecord]], share: float) -> tuple[ReaderDataset, str]:
    """The reader's rows, ``share`` of the questions (``promotion_holdout``, a fifth) held out as
    its regression set unless what is left is too little; and why they are too few ("" if enough)."""

    def short(built: ReaderDataset) -> str:
        counts = built.counts
        if (
            len(built.rows) >= READER_MIN_ROWS
            and min(counts["positive"], counts["negative"]) >= READER_MIN_PER_LABEL
        ):
            return ""
        return (
            f"too little feedback on extractive answers for the reader: {counts['positive']} answering and "
            f"{counts['negative']} non-answering sentences, at least {READER_MIN_ROWS} rows with "
            f"{READER_MIN_PER_LABEL} of each needed"
        )

    built = reader_dataset(rated, lambda q: held_out(f"reader:{q}", share))
    if short(built) and built.held_out:
        built = reader_dataset(rated)
    return built, short(built)


async def _reader_kind(inference: InferenceClient, name: str) -> str | None:
    """The kind of the published reader ``name`` as the inference service lists it (None: not
    served, or a configured rerank model)."""
    for card in await inference.models():
        if card.id == name and card.kind == "rerank":
            kind = (card.model_extra or {}).get("reader_kind")
            return str(kind) if kind else None
    return None


async def _train_reader(
    runtime: AgentRuntime, principal: Principal, key: str, req: TrainRequest
) -> ReaderTraining:
    """The tenant's reader trained further on the feedback about extractive answers (the
    sentences the reader picked, rated or corrected), gated like a fine-tune. It never fails the
    model's round: why no reader job started is in ``reason``."""
    rated = (await _feedback(runtime, principal, req)).feedback
    built, reason = _reader_rows(rated, runtime.settings.promotion_holdout)
    if reason:
        return ReaderTraining(started=False, reason=reason, rows=len(built.rows), counts=built.counts)
    choice = await runtime.promotions.choice(principal.tenant)
    current = choice.reader.name if choice.reader else runtime.settings.reader
    job_body: JobBody = {"type": "reader", "publish": True}
    if current and current != FEATURES_READER:
        # the reader answering now trains further, as what it is (a cross-encoder or a bi-encoder;
        # the shipped features scorer is neither: the job then starts from its own base)
        job_body["base_model"] = current
    try:
        kind = await _reader_kind(runtime.upstreams.inference(key), current) if current else None
        if kind is not None:
            job_body["reader_kind"] = kind
        trainer = runtime.upstreams.trainer(key)
        stored = await trainer.upload_file(f"feedback-reader-{int(time.time())}.jsonl", built.jsonl())
        job_body["dataset"] = str(stored["id"])
        try:
            job = await trainer.create_job(job_body)
        except NotFound:
            # the reader answering now is not published (yet): the trainer's base starts it
            from_base = job_body.copy()
            from_base.pop("base_model", None)
            job = await trainer.create_job(from_base)
    except TandemError as exc:
        log.warning("train on feedback: no reader job for tenant %s: %s", principal.tenant, exc.message)
        return ReaderTraining(
            started=False, reason=f"the trainer refused the reader job: {exc.message}", counts=built.counts
        )
    held = set(built.held_out)
    promotion = Promotion(
        job_id=str(job["id"]),
        kind="reader",
        replaces=current,
        status="training",
        margin=runtime.settings.promotion_margin,
        holdout=built.held_out,
        created_at=time.time(),
        collections=sorted(
            {
                rec.collection
                for fb, rec in rated
                if rec.collection and rec.message_id not in held and rows_from_feedback(fb, rec)
            }
        ),
    )
    await runtime.promotions.save(principal.tenant, promotion)
    return ReaderTraining(
        started=True,
        file_id=job_body["dataset"],
        rows=len(built.rows),
        counts=built.counts,
        job=job,
        promotion=promotion,
    )
