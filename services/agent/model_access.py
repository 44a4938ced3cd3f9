"""Which of the tenant's fine-tunes from feedback a caller is served.

A fine-tune trained on feedback remembers the collections its rows' answers came from
(``Promotion.collections``, mirrored for the inference service by ``PromotionStore.save``). It
answers a caller only if that caller may read every one of them, by the collections' access
lists; an admin may allow it for the whole tenant whatever it was trained on
(``POST /v1/models/{id}/allow``, recorded in the audit log as ``model.allow``). The decision is
services/common/model_restrictions.py's, the same the inference service makes for a caller who
names the model there.

A caller who may not use a fine-tune is served, where it was the tenant's default (or its
canary), the previous default it may use, down to the base model; the tenant's reader falls
back the same way. Where the caller named the model (a turn's ``llm`` on every interface, a
conversation's model, a regenerated answer's) the answer is a 403 that says why and
names no collection (a collection the caller may not read is, to it, one that does not exist).
"""

from __future__ import annotations

from services.agent.model_choice import chat_model
from services.agent.protocol import ModelChoice, ReaderChoice
from services.common.auth import Principal
from services.common.model_restrictions import ModelRestrictions


class CallerModels:
    """The models one caller may be served, for one turn: the access lists are read only when a
    restricted fine-tune is about to answer."""

    def __init__(self, restrictions: ModelRestrictions, principal: Principal) -> None:
        self.restrictions = restrictions
        self.principal = principal

    async def may_use(self, model: str | None) -> bool:
        """``model`` (None or '': the base model) may answer this caller."""
        return not await self.restrictions.withheld(self.principal, model)

    async def check_named(self, model: str, param: str = "llm") -> None:
        """A 403 saying why, when the caller named a model it may not use."""
        await self.restrictions.check_named(self.principal, model, param)

    async def default(self, choice: ModelChoice, message_id: str) -> str | None:
        """The tenant's model for this turn (its canary for a share of turns) if the caller may use
        it, else the newest earlier default it may use; None: the base model."""
        picked = chat_model(choice, message_id)
        if await self.may_use(picked):
            return picked
        for model in [choice.default, *reversed(choice.previous)]:
            if await self.may_use(model):
                return model or None
        return None

    async def reader(self, choice: ModelChoice) -> ReaderChoice | None:
        """The tenant's reader if the caller may use it, else the newest earlier one it may use;
        None: the agent's reader setting."""
        for reader in [choice.reader, *reversed(choice.previous_readers)]:
            if reader is None or not reader.name:
                return None
            if await self.may_use(reader.name):
                return reader
        return None
