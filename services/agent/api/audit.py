"""``GET /v1/audit``: the tenant's audit log (services/common/audit.py), for its admins.

Filtered by actor (a user's or key's id), action and time; newest first a page at a time, or
every matching entry, oldest first, as JSON lines (``format=jsonl`` or
``Accept: application/jsonl``), streamed as it is read.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from services.agent.api.deps import PrincipalDep
from services.common.audit import AuditFilter, AuditLog, id_before
from services.common.auth import require_admin
from services.common.bounds import MAX_UNIX_S
from services.common.errors import InvalidRequest

router = APIRouter(tags=["audit"])

JSONL = "application/jsonl"
JSONL_TYPES = (JSONL, "application/x-ndjson", "application/jsonlines")
ENTRY_ID = r"^[0-9]{1,20}-[0-9]{1,20}$"


@router.get(
    "/v1/audit",
    responses={
        200: {"content": {JSONL: {}}, "description": "a page of entries (JSON), or every entry (JSON lines)"},
        400: {"description": "since after until, or a bad filter or entry id"},
        403: {"description": "not an admin of the tenant"},
    },
)
async def read_audit(
    request: Request,
    principal: PrincipalDep,
    actor: str | None = Query(None, max_length=64, description="a user's or key's id"),
    action: str | None = Query(None, max_length=64, description="e.g. user.create, model.promote"),
    since: float | None = Query(None, ge=0, le=MAX_UNIX_S, description="at or after (unix seconds)"),
    until: float | None = Query(None, ge=0, le=MAX_UNIX_S, description="at or before (unix seconds)"),
    limit: int = Query(100, ge=1, le=1000),
    before: str | None = Query(
        None, max_length=41, pattern=ENTRY_ID, description="entries older than this entry id (the next page)"
    ),
    format: Literal["json", "jsonl"] | None = Query(
        None, description="jsonl: every matching entry, streamed"
    ),
) -> Any:
    require_admin(principal, "GET /v1/audit")
    if since is not None and until is not None and since > until:
        raise InvalidRequest(f"since: {since} is after until ({until})", param="since")
    if before is not None:
        try:
            id_before(before)
        except ValueError:
            raise InvalidRequest(f"before: {before!r} is not an audit entry id", param="before") from None
    filt = AuditFilter(actor=actor, action=action, since=since, until=until)
    log: AuditLog = request.app.state.audit
    accept = request.headers.get("accept", "")
    if format == "jsonl" or (format is None and any(t in accept for t in JSONL_TYPES)):

        async def lines() -> AsyncIterator[bytes]:
            async for entry in log.export(principal.tenant, filt):
                yield entry.model_dump_json().encode() + b"\n"

        return StreamingResponse(lines(), media_type=JSONL)
    entries, more = await log.entries(principal.tenant, filt, limit, before)
    return {
        "data": [e.model_dump() for e in entries],
        "has_more": more,
        "next_before": entries[-1].id if more and entries else None,
    }
