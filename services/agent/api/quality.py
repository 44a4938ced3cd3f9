"""Answer quality over time (``GET /v1/quality``) and the worst recent answers
(``GET /v1/quality/worst``), from the quality signals on the caller's tenant's turn records
(a member key's worst answers are its own; the report's figures are the tenant's)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Query

from services.agent.api.deps import PrincipalDep, RuntimeDep
from services.agent.protocol import (
    QualityBucketName,
    QualityPoint,
    QualityReport,
    WorstAnswer,
    WorstAnswers,
)
from services.agent.quality import BUCKET_SECONDS
from services.agent.turns import owner_scope
from services.common.bounds import MAX_UNIX_S

router = APIRouter(tags=["quality"])

# Without ``since``: the last 30 buckets of the report, the last week of worst answers.
DEFAULT_BUCKETS = 30
DEFAULT_WORST_WINDOW_S = 7 * 86400
# since: a finite time before 2100 (inf, 1e400 and NaN are 400s naming it)
SINCE_DOC = "answers produced at or after (unix seconds, before 2100)"


@router.get(
    "/v1/quality",
    response_model=QualityReport,
    responses={400: {"description": "a bad parameter (named in the error)"}},
)
async def quality_report(
    runtime: RuntimeDep,
    principal: PrincipalDep,
    model: str | None = Query(None, min_length=1, max_length=256, description="one model only"),
    since: float | None = Query(
        None, ge=0, le=MAX_UNIX_S, description=f"{SINCE_DOC}; default: the last 30 buckets"
    ),
    bucket: QualityBucketName = Query("day", description="hour, day or week (UTC; weeks start on Monday)"),
) -> QualityReport:
    bucket_s = BUCKET_SECONDS[bucket]
    start = time.time() - DEFAULT_BUCKETS * bucket_s if since is None else since
    rows = await runtime.turns.quality_series(principal.tenant, start, bucket_s, model)
    return QualityReport(bucket=bucket, since=start, data=[QualityPoint(**r) for r in rows])


@router.get(
    "/v1/quality/worst",
    response_model=WorstAnswers,
    responses={400: {"description": "a bad parameter (named in the error)"}},
)
async def worst_answers(
    runtime: RuntimeDep,
    principal: PrincipalDep,
    limit: int = Query(10, ge=1, le=100),
    since: float | None = Query(
        None, ge=0, le=MAX_UNIX_S, description=f"{SINCE_DOC}; default: the last 7 days"
    ),
    model: str | None = Query(None, min_length=1, max_length=256),
) -> WorstAnswers:
    start = time.time() - DEFAULT_WORST_WINDOW_S if since is None else since
    rows = await runtime.turns.worst_answers(principal.tenant, start, limit, model, owner_scope(principal))
    data = []
    for record, rating in rows:
        q = record.quality
        assert q is not None  # only records with quality are in the quality table
        data.append(
            WorstAnswer(
                message_id=record.message_id,
                conversation_id=record.conversation_id,
                pipeline=record.pipeline,
                model=q.model,
                collection=record.collection,
                created_at=record.created_at,
                question=record.question,
                answer=record.answer,
                groundedness=q.groundedness,
                cited=q.cited,
                answer_kind=q.answer_kind,
                rating=1 if rating == 1 else -1 if rating == -1 else None,
            )
        )
    return WorstAnswers(since=start, data=data)
