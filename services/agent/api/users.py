"""``/v1/users``: the tenant's people and their personal tokens (services/common/users.py).

Admins (an admin key, or a user with the admin role) create, change and remove users; a user
may also read its own record and list, create and revoke its own tokens. Every change is
recorded in the tenant's audit log.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request, Response

from services.agent.api.deps import PrincipalDep
from services.agent.protocol import TokenCreate, TokenCreated, UserCreate, UserUpdate
from services.common.app_factory import RouteResponses
from services.common.audit import actor_of
from services.common.auth import Principal, require_admin
from services.common.users import Token, TokenList, User, UserList, UserStore

router = APIRouter(tags=["users"])

UserId = Annotated[str, Path(max_length=64)]
TokenId = Annotated[str, Path(max_length=64)]

FORBIDDEN: RouteResponses = {
    403: {"description": "not an admin (a user may only read itself and manage its own tokens)"}
}
NO_USER: RouteResponses = {404: {"description": "no user with that id in this tenant (the message names it)"}}
BAD: RouteResponses = {400: {"description": "an invalid field (the message names it and its value)"}}
LAST_ADMIN: RouteResponses = {
    409: {"description": "the change would leave the tenant without an admin, or the email is taken"}
}


def users_of(request: Request) -> UserStore:
    store: UserStore = request.app.state.users
    return store


Users = Annotated[UserStore, Depends(users_of)]


async def _audit(request: Request, principal: Principal, action: str, target: str, **detail: Any) -> None:
    await request.app.state.audit.record(principal.tenant, actor_of(principal), action, target, detail)


def _self_or_admin(principal: Principal, user_id: str, what: str) -> None:
    if principal.user_id != user_id:
        require_admin(principal, what)


@router.post("/v1/users", status_code=201, response_model=User, responses={**BAD, **FORBIDDEN, **LAST_ADMIN})
async def create_user(body: UserCreate, request: Request, users: Users, principal: PrincipalDep) -> User:
    require_admin(principal, "POST /v1/users")
    user = await users.create(principal.tenant, body.email, body.role, body.groups)
    await _audit(
        request, principal, "user.create", user.id, email=user.email, role=user.role, groups=user.groups
    )
    return user


@router.get("/v1/users", responses=FORBIDDEN)
async def list_users(users: Users, principal: PrincipalDep) -> UserList:
    require_admin(principal, "GET /v1/users")
    return UserList(data=await users.users(principal.tenant))


@router.get("/v1/users/{user_id}", response_model=User, responses={**FORBIDDEN, **NO_USER})
async def get_user(user_id: UserId, users: Users, principal: PrincipalDep) -> User:
    _self_or_admin(principal, user_id, "GET /v1/users/{user_id} of another user")
    return await users.get(principal.tenant, user_id)


@router.patch(
    "/v1/users/{user_id}", response_model=User, responses={**BAD, **FORBIDDEN, **NO_USER, **LAST_ADMIN}
)
async def update_user(
    user_id: UserId, body: UserUpdate, request: Request, users: Users, principal: PrincipalDep
) -> User:
    require_admin(principal, "PATCH /v1/users/{user_id}")
    before, after = await users.update(
        principal.tenant, user_id, email=body.email, role=body.role, groups=body.groups
    )
    changed = {
        field: {"from": getattr(before, field), "to": getattr(after, field)}
        for field in ("email", "role", "groups")
        if getattr(before, field) != getattr(after, field)
    }
    await _audit(request, principal, "user.update", user_id, **changed)
    return after


@router.delete("/v1/users/{user_id}", status_code=204, responses={**FORBIDDEN, **NO_USER, **LAST_ADMIN})
async def delete_user(user_id: UserId, request: Request, users: Users, principal: PrincipalDep) -> Response:
    require_admin(principal, "DELETE /v1/users/{user_id}")
    user = await users.delete(principal.tenant, user_id)
    await _audit(request, principal, "user.delete", user_id, email=user.email, role=user.role)
    return Response(status_code=204)


@router.get("/v1/users/{user_id}/tokens", responses={**FORBIDDEN, **NO_USER})
async def list_tokens(user_id: UserId, users: Users, principal: PrincipalDep) -> TokenList:
    """Names, ids, when made, last used and expiring; never the tokens themselves."""
    _self_or_admin(principal, user_id, "GET /v1/users/{user_id}/tokens of another user")
    return TokenList(data=await users.tokens(principal.tenant, user_id))


@router.post(
    "/v1/users/{user_id}/tokens",
    status_code=201,
    response_model=TokenCreated,
    responses={**BAD, **FORBIDDEN, **NO_USER},
)
async def create_token(
    user_id: UserId, body: TokenCreate, request: Request, users: Users, principal: PrincipalDep
) -> TokenCreated:
    """A personal token acting with the user's role; ``token`` is shown this once."""
    _self_or_admin(principal, user_id, "POST /v1/users/{user_id}/tokens for another user")
    token, record = await users.create_token(principal.tenant, user_id, body.name, body.expires_at)
    await _audit(request, principal, "token.create", record.id, user_id=user_id, name=record.name)
    return TokenCreated(**record.model_dump(exclude={"last_used_at", "revoked"}), token=token)


@router.delete(
    "/v1/users/{user_id}/tokens/{token_id}",
    response_model=Token,
    responses={**FORBIDDEN, 404: {"description": "no such user, or no such token of that user"}},
)
async def revoke_token(
    user_id: UserId, token_id: TokenId, request: Request, users: Users, principal: PrincipalDep
) -> Token:
    """Revokes at once, in every service; the token is then a 401 that says it was revoked."""
    _self_or_admin(principal, user_id, "DELETE /v1/users/{user_id}/tokens/{token_id} of another user")
    record = await users.revoke_token(principal.tenant, user_id, token_id)
    await _audit(request, principal, "token.revoke", token_id, user_id=user_id, name=record.name)
    return record
