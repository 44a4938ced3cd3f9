"""Evaluation sets and runs of the caller's tenant (``/v1/evals/...``): sets of questions with
their expected answers, uploaded as JSON lines or added from chat answers; runs of a set through a
pipeline in the background; two runs compared. Another tenant's set or run is a 404."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.requests import HTTPConnection

from services.agent.api.deps import CallerDep, PrincipalDep, RuntimeDep
from services.agent.evals.jsonl import LineError, json_objects
from services.agent.evals.protocol import (
    MAX_QUESTIONS,
    EvalQuestion,
    EvalRun,
    EvalRunCreate,
    EvalRunList,
    EvalSet,
    EvalSetCreate,
    EvalSetList,
    EvalSetPatch,
    FromMessage,
    GatedReindex,
    QuestionPatch,
    QuestionsUpload,
    ReindexRequest,
    RunComparison,
)
from services.agent.evals.reindex import gated_reindex
from services.agent.evals.runs import Evaluations, compare
from services.agent.evals.store import new_id
from services.agent.turns import TurnStore
from services.common.auth import Principal, require_admin
from services.common.errors import InvalidRequest, NotFound, describe_validation_error

router = APIRouter(
    tags=["evaluations"],
    responses={
        404: {"description": "no such set, run or question for this tenant"},
        413: {"description": "more questions than a set may hold (TANDEM_AGENT_EVAL_MAX_QUESTIONS)"},
    },
)

JSONL_TYPES = ("application/jsonl", "application/x-ndjson", "application/json-lines", "text/plain")
SetId = Annotated[str, Path(min_length=1, max_length=64)]
RunId = Annotated[str, Path(min_length=1, max_length=64)]


def evaluations(conn: HTTPConnection) -> Evaluations:
    evals: Evaluations = conn.app.state.evals
    return evals


EvalsDep = Annotated[Evaluations, Depends(evaluations)]


def _invalid(exc: ValidationError, where: str = "") -> InvalidRequest:
    message, param = describe_validation_error(RequestValidationError(exc.errors()))
    return InvalidRequest(f"{where}{message}", param=param)


def parse_jsonl(lines: Iterable[str]) -> list[EvalQuestion]:
    """Questions of a JSON-lines text (blank lines and ``#`` lines skipped); a malformed line is a
    400 naming its number."""
    out: list[EvalQuestion] = []
    try:
        for n, data in json_objects(lines):
            try:
                out.append(EvalQuestion.model_validate(data))
            except ValidationError as exc:
                raise _invalid(exc, f"line {n}: ") from None
    except LineError as exc:
        raise InvalidRequest(str(exc), param="jsonl") from None
    if not out:
        raise InvalidRequest("no questions in the upload", param="jsonl")
    return out


def numbered(existing: list[EvalQuestion], new: list[EvalQuestion]) -> list[EvalQuestion]:
    """``existing`` + ``new``, each with an id unique in the set (``q<n>`` for those without)."""
    taken = {q.id for q in existing if q.id}
    out = list(existing)
    for i, q in enumerate(new, start=1):
        if q.id is not None and q.id in taken:
            raise InvalidRequest(f"question {i}: id {q.id!r} is already in the set", param="id")
        if q.id is None:
            n = len(out) + 1
            while f"q{n}" in taken:
                n += 1
            q = q.model_copy(update={"id": f"q{n}"})
        assert q.id is not None
        taken.add(q.id)
        out.append(q)
    return out


async def from_message(turns: TurnStore, tenant: str, body: FromMessage) -> EvalQuestion:
    """A chat answer as a question: its question, the document it cited first as the source, the
    given reference, else the answer's correction, else the answer itself."""
    turn = await turns.get_turn(tenant, body.message_id)
    if turn is None or not turn.question.strip():
        raise NotFound(f"no chat answer {body.message_id!r}", param="from_message.message_id")
    reference = body.reference
    if reference is None:
        feedback = (await turns.feedback_of(tenant, [turn.message_id])).get(turn.message_id)
        reference = (feedback.correction if feedback else None) or turn.answer
    cited = next((c for c in turn.citations if c.get("document_id")), None)
    try:
        return EvalQuestion.model_validate(
            {
                "question": turn.question,
                "reference": reference,
                "source": str(cited["document_id"]) if cited else None,
            }
        )
    except ValidationError as exc:
        raise _invalid(exc, "from_message: ") from None


# -- sets --------------------------------------------------------------------------------------


def _may_change(principal: Principal, s: EvalSet | None = None, *, marking: bool = False) -> None:
    """Regression sets gate the tenant's promotions and reindexes: only an admin makes, edits or
    deletes one, or a member could empty the gate before promoting what it trained."""
    if marking or (s is not None and s.regression):
        require_admin(principal, "changing a regression set")


@router.post("/v1/evals/sets", response_model=EvalSet, status_code=201)
async def create_set(body: EvalSetCreate, evals: EvalsDep, principal: PrincipalDep) -> EvalSet:
    _may_change(principal, marking=body.regression)
    evals.limit_check(len(body.questions))
    now = time.time()
    s = EvalSet(
        id=new_id("evset"),
        name=body.name,
        collection=body.collection,
        regression=body.regression,
        questions=numbered([], body.questions),
        created_at=now,
        updated_at=now,
    )
    await evals.store.put_set(principal.tenant, s)
    return s


@router.get("/v1/evals/sets", response_model=EvalSetList)
async def list_sets(evals: EvalsDep, principal: PrincipalDep) -> EvalSetList:
    return EvalSetList(data=[s.summary() for s in await evals.store.sets(principal.tenant)])


@router.get("/v1/evals/sets/{set_id}", response_model=EvalSet)
async def get_set(set_id: SetId, evals: EvalsDep, principal: PrincipalDep) -> EvalSet:
    return await evals.store.get_set(principal.tenant, set_id)


@router.patch("/v1/evals/sets/{set_id}", response_model=EvalSet)
async def patch_set(set_id: SetId, body: EvalSetPatch, evals: EvalsDep, principal: PrincipalDep) -> EvalSet:
    change = body.model_dump(exclude_unset=True, exclude_none=True)

    def apply(s: EvalSet) -> EvalSet:
        _may_change(principal, s, marking="regression" in change)
        return s.model_copy(update={**change, "updated_at": time.time()})

    return await evals.store.update_set(principal.tenant, set_id, apply)


@router.delete("/v1/evals/sets/{set_id}", status_code=204)
async def delete_set(set_id: SetId, evals: EvalsDep, principal: PrincipalDep) -> Response:
    _may_change(principal, await evals.store.get_set(principal.tenant, set_id))
    await evals.store.delete_set(principal.tenant, set_id)
    return Response(status_code=204)


@router.post(
    "/v1/evals/sets/{set_id}/questions",
    response_model=EvalSet,
    openapi_extra={
        "requestBody": {
            "content": {
                "application/jsonl": {"schema": {"type": "string"}},
                "application/json": {"schema": QuestionsUpload.model_json_schema()},
            }
        }
    },
)
async def add_questions(
    set_id: SetId,
    request: Request,
    evals: EvalsDep,
    runtime: RuntimeDep,
    principal: PrincipalDep,
    replace: bool = Query(False, description="swap the set's questions for these (JSON lines bodies)"),
) -> EvalSet:
    """JSON lines (``application/jsonl``: one question per line, the ``tandem eval rag`` format),
    or JSON: ``{"jsonl"}``, ``{"questions"}`` or ``{"from_message": {"message_id", "reference"?}}``,
    with ``replace``. A malformed line is a 400 naming it; more than the set's limit a 413."""
    tenant = principal.tenant
    # another tenant's set: 404 before reading the body
    _may_change(principal, await evals.store.get_set(tenant, set_id))
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("the body is not UTF-8 text") from None
    if kind in JSONL_TYPES:
        new = parse_jsonl(text.splitlines())
    else:
        try:
            body = QuestionsUpload.model_validate_json(text or "{}")
        except ValidationError as exc:
            raise _invalid(exc) from None
        replace = replace or body.replace
        if body.jsonl is not None:
            new = parse_jsonl(body.jsonl.splitlines())
        elif body.questions is not None:
            new = body.questions
        else:
            assert body.from_message is not None
            new = [await from_message(runtime.turns, tenant, body.from_message)]

    def apply(s: EvalSet) -> EvalSet:
        questions = numbered([] if replace else s.questions, new)
        evals.limit_check(len(questions))
        return s.model_copy(update={"questions": questions, "updated_at": time.time()})

    return await evals.store.update_set(tenant, set_id, apply)


QuestionN = Annotated[int, Path(ge=1, le=MAX_QUESTIONS, description="1-based place in the set")]


def _nth(s: EvalSet, n: int) -> None:
    if n > len(s.questions):
        raise NotFound(f"the set has {len(s.questions)} questions, not {n}", param="n")


@router.patch("/v1/evals/sets/{set_id}/questions/{n}", response_model=EvalQuestion)
async def patch_question(
    set_id: SetId, n: QuestionN, body: QuestionPatch, evals: EvalsDep, principal: PrincipalDep
) -> EvalQuestion:
    change = body.model_dump(exclude_unset=True)

    def apply(s: EvalSet) -> EvalSet:
        _may_change(principal, s)
        _nth(s, n)
        old = s.questions[n - 1]
        try:
            new = EvalQuestion.model_validate({**old.model_dump(), **change})
        except ValidationError as exc:
            raise _invalid(exc) from None
        questions = [*s.questions[: n - 1], new, *s.questions[n:]]
        return s.model_copy(update={"questions": questions, "updated_at": time.time()})

    updated = await evals.store.update_set(principal.tenant, set_id, apply)
    return updated.questions[n - 1]


@router.delete("/v1/evals/sets/{set_id}/questions/{n}", status_code=204)
async def delete_question(set_id: SetId, n: QuestionN, evals: EvalsDep, principal: PrincipalDep) -> Response:
    def apply(s: EvalSet) -> EvalSet:
        _may_change(principal, s)
        _nth(s, n)
        questions = [*s.questions[: n - 1], *s.questions[n:]]
        return s.model_copy(update={"questions": questions, "updated_at": time.time()})

    await evals.store.update_set(principal.tenant, set_id, apply)
    return Response(status_code=204)


# -- runs --------------------------------------------------------------------------------------


@router.post("/v1/evals/runs", response_model=EvalRun, status_code=202)
async def start_run(body: EvalRunCreate, evals: EvalsDep, who: CallerDep) -> EvalRun:
    return await evals.start(who.principal, who.key, body)


@router.get("/v1/evals/runs", response_model=EvalRunList)
async def list_runs(
    evals: EvalsDep,
    principal: PrincipalDep,
    set_id: str | None = Query(None, alias="set", min_length=1, max_length=64, description="one set's runs"),
    limit: int = Query(50, ge=1, le=1000),
) -> EvalRunList:
    """Newest first, without their answers."""
    tenant = principal.tenant
    if set_id is not None:
        await evals.store.get_set(tenant, set_id)
        ids = [set_id]
    else:
        ids = [s.id for s in await evals.store.sets(tenant)]
    runs = await evals.store.runs(tenant, ids, limit)
    return EvalRunList(data=[(await evals.run(tenant, r.id)).summary() for r in runs])


@router.get("/v1/evals/runs/{run_id}", response_model=EvalRun)
async def get_run(run_id: RunId, evals: EvalsDep, principal: PrincipalDep) -> EvalRun:
    return await evals.run(principal.tenant, run_id)


@router.get("/v1/evals/runs/{a}/compare/{b}", response_model=RunComparison)
async def compare_runs(a: RunId, b: RunId, evals: EvalsDep, principal: PrincipalDep) -> RunComparison:
    """What run ``b`` fixed and broke against run ``a``, and each metric's difference."""
    return compare(await evals.run(principal.tenant, a), await evals.run(principal.tenant, b))


# -- a reindex gated by the regression sets -----------------------------------------------------

CollectionName = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]


@router.post(
    "/v1/collections/{name}/reindex",
    response_model=GatedReindex,
    status_code=202,
    responses={
        400: {"description": "no gate: no regression query maps to a document, or no queries"},
        403: {"description": "a member key"},
        404: {"description": "no such collection"},
        409: {"description": "a reindex of the collection is running"},
    },
)
async def reindex_collection(
    name: CollectionName, body: ReindexRequest, evals: EvalsDep, who: CallerDep
) -> GatedReindex:
    """Reindex ``name`` with ``embedder`` (retrieval's ``PATCH /v1/collections/{name}``), switching
    only if the new index ranks the tenant's regression questions over the collection (and
    ``queries``) better by more than ``min_gain``."""
    require_admin(who.principal, "POST /v1/collections/{name}/reindex")
    retrieval = evals.upstreams.retrieval(who.key)
    return await gated_reindex(evals.store, retrieval, who.principal.tenant, name, body)
