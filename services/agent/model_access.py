"""Which of the tenant's fine-tunes from feedback a caller is served.

A fine-tune trained on feedback remembers the collections its rows' answers came from
(``Promotion.collections``). It may have learnt their contents, so it answers a caller only if
that caller may read every one of them: retrieval's ``GET /v1/collections``, asked with the
caller's own credential, lists exactly the collections the caller may read. An admin may allow
a fine-tune for the whole tenant whatever it was trained on (``POST /v1/models/{id}/allow``,
recorded in the audit log as ``model.allow``); admins read every collection, so nothing is
withheld from them.

A caller who may not use a fine-tune is served, where it was the tenant's default (or its
canary), the previous default it may use, down to the base model; the tenant's reader falls
back the same way. Where the caller named the model (a turn's ``llm`` on every interface, a
conversation's model, a regenerated answer's) the answer is a 403 that says why and
names no collection (a collection the caller may not read is, to it, one that does not exist).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from services.agent.promotions import PromotionStore, chat_model
from services.agent.protocol import ModelChoice, Promotion, ReaderChoice
from services.common.auth import Principal
from services.common.errors import Forbidden


async def withheld(promotion: Promotion | None, readable: Callable[[], Awaitable[set[str]]]) -> bool:
    """Whether ``promotion``'s fine-tune is withheld from a caller who may read ``readable()``."""
    if promotion is None or not promotion.collections or promotion.allowed is not None:
        return False
    return not set(promotion.collections) <= await readable()


class CallerModels:
    """The models one caller may be served, for one turn: retrieval is asked at most once what
    the caller may read, and only when a restricted fine-tune is about to answer."""

    def __init__(
        self,
        store: PromotionStore,
        principal: Principal,
        readable: Callable[[], Awaitable[set[str]]],
    ) -> None:
        self.store = store
        self.principal = principal
        self._ask = readable
        self._readable: set[str] | None = None

    async def readable(self) -> set[str]:
        if self._readable is None:
            self._readable = await self._ask()
        return self._readable

    async def may_use(self, model: str | None) -> bool:
        """``model`` (None or '': the base model) may answer this caller."""
        if not model or self.principal.is_admin:
            return True
        return not await withheld(await self.store.trained_as(self.principal.tenant, model), self.readable)

    async def check_named(self, model: str, param: str = "llm") -> None:
        """A 403 saying why, when the caller named a model it may not use."""
        if not await self.may_use(model):
            raise Forbidden(
                f"{param}: model {model!r} was fine-tuned on feedback about collections this caller may not "
                "read; use another model, or ask an admin to allow it for everyone "
                f"(POST /v1/models/{model}/allow)",
                param=param,
                code="model_withheld",
            )

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
