"""GET /v1/conversations, GET|PATCH|DELETE /v1/conversations/{id}: the caller's own conversations.

An admin key also reads the tenant's other keys' conversations (``?key_id=`` lists one key's;
GET by id opens any); a member key's view of another key's conversation is a 404, as if it did
not exist. Renaming and deleting stay with the conversation's owner."""

from __future__ import annotations

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from services.agent.api.deps import PrincipalDep, RuntimeDep
from services.agent.memory import Conversation, ConversationSummary
from services.common.auth import require_admin
from services.common.errors import NotFound

router = APIRouter(tags=["conversations"], responses={404: {"description": "no such conversation"}})


class ConversationList(BaseModel):
    """The caller's conversations, the most recently active first."""

    data: list[ConversationSummary]


@router.get("/v1/conversations")
async def list_conversations(
    runtime: RuntimeDep,
    principal: PrincipalDep,
    limit: int = Query(100, ge=1, le=1000),
    key_id: str | None = Query(
        None, min_length=1, max_length=64, description="admin keys: this key's conversations instead"
    ),
) -> ConversationList:
    owner = principal.owner
    if key_id is not None and key_id != owner:
        require_admin(principal, "GET /v1/conversations?key_id=")
        owner = key_id
    items = await runtime.memory.list(principal.tenant, owner, limit)
    return ConversationList(data=items)


@router.get("/v1/conversations/{conversation_id}")
async def get_conversation(
    conversation_id: str, runtime: RuntimeDep, principal: PrincipalDep
) -> Conversation:
    owner = principal.owner
    if principal.is_admin:
        owner = await runtime.memory.owner(principal.tenant, conversation_id) or owner
    conversation = await runtime.memory.get(principal.tenant, owner, conversation_id)
    # The caller's feedback rides on its messages, so a reopened conversation shows its thumbs.
    ids = [str(m["message_id"]) for m in conversation.messages if m.get("message_id")]
    given = await runtime.turns.feedback_of(principal.tenant, ids)
    for message in conversation.messages:
        row = given.get(str(message.get("message_id", "")))
        if row is not None:
            message["feedback"] = {"rating": row.rating, "correction": row.correction, "comment": row.comment}
    return conversation


class Rename(BaseModel):
    model_config = ConfigDict(extra="forbid")

    title: str = Field(min_length=1, max_length=120)


@router.patch("/v1/conversations/{conversation_id}")
async def rename_conversation(
    conversation_id: str, body: Rename, runtime: RuntimeDep, principal: PrincipalDep
) -> ConversationSummary:
    return await runtime.memory.rename(principal.tenant, principal.key_id, conversation_id, body.title)


@router.delete("/v1/conversations/{conversation_id}", status_code=204)
async def delete_conversation(conversation_id: str, runtime: RuntimeDep, principal: PrincipalDep) -> Response:
    """Deletes the conversation and, with it, its turn records (and their feedback): the only way
    records go. A conversation whose memory already expired still has records to delete."""
    try:
        await runtime.memory.delete(principal.tenant, principal.key_id, conversation_id)
        found = True
    except NotFound:
        found = False
    deleted = await runtime.turns.delete_conversation(principal.tenant, principal.key_id, conversation_id)
    if not found and not deleted:
        raise NotFound(f"no conversation {conversation_id!r}", param="conversation_id")
    return Response(status_code=204)
