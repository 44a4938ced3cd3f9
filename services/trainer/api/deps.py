"""What the routers share: the app's trainer state and the caller, as ``Annotated`` dependencies.

A handler names what it needs in its signature (``st: TrainerDep, tenant: TenantDep``), the
way the FastAPI full-stack template does, instead of digging it out of the request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path
from starlette.requests import HTTPConnection

from services.common.auth import Principal, acting_principal, principal_of
from services.trainer.state import TrainerState
from services.trainer.store import JobRecord


def state_of(conn: HTTPConnection) -> TrainerState:
    st = conn.app.state.trainer
    assert isinstance(st, TrainerState)
    return st


TrainerDep = Annotated[TrainerState, Depends(state_of)]
PrincipalDep = Annotated[Principal, Depends(principal_of)]
# An operator key may act for a tenant (X-Tandem-Tenant): the agent's promotion gate reads its jobs.
ActingDep = Annotated[Principal, Depends(acting_principal)]


def caller_tenant(principal: ActingDep) -> str:
    return principal.tenant


TenantDep = Annotated[str, Depends(caller_tenant)]


def owned_job(st: TrainerDep, tenant: TenantDep, job_id: Annotated[str, Path()]) -> JobRecord:
    """The caller's job ``job_id``; another tenant's is a 404 like a missing one."""
    return st.store.get_job(tenant, job_id)


JobDep = Annotated[JobRecord, Depends(owned_job)]
