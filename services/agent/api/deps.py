"""What the routers need, as ``Annotated`` dependencies (the FastAPI full-stack template's way):
the runtime, and the caller with the key it presented (passed on to retrieval and inference).

A handler names them in its signature (``runtime: RuntimeDep, caller: CallerDep``) instead of
digging them out of the request; the websocket route calls ``runtime_of``/``caller`` itself.
"""

from __future__ import annotations

from typing import Annotated, NamedTuple

from fastapi import Depends
from starlette.requests import HTTPConnection

from services.agent.runtime import AgentRuntime
from services.common.auth import Principal, credential
from services.common.errors import Unauthorized


class Caller(NamedTuple):
    principal: Principal
    key: str


def runtime_of(conn: HTTPConnection) -> AgentRuntime:
    runtime: AgentRuntime = conn.app.state.runtime
    return runtime


def caller(conn: HTTPConnection) -> Caller:
    """The authenticated principal and the credential itself: the bearer key or token, or the
    token of a browser's session cookie, which the other services then receive as a bearer."""
    principal = getattr(conn.state, "principal", None)
    cred = credential(conn)
    if not isinstance(principal, Principal) or cred is None:
        raise Unauthorized("not authenticated")
    return Caller(principal, cred.token)


def principal(who: Annotated[Caller, Depends(caller)]) -> Principal:
    return who.principal


RuntimeDep = Annotated[AgentRuntime, Depends(runtime_of)]
CallerDep = Annotated[Caller, Depends(caller)]
PrincipalDep = Annotated[Principal, Depends(principal)]
