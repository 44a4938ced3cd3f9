"""The model a tenant's chat answers with, and the records of fine-tunes from its feedback.

A tenant's ``ModelChoice`` names its default model for chat (None: the base model), a canary
answering a share of its chats, and its reader, each with the ones before it for rollback; the
pure functions here change it (promote, canary, roll back). ``PromotionStore`` keeps the choice
and each ``Promotion`` (a fine-tune or reader trained on feedback, and the gate's verdict on it,
services/agent/promotions.py) in the turn store's database, so they are as durable as the
feedback they come from.

Which turns a canary answers, and which answers are held out of training as the tenant's
regression set, are decided by a hash of the message id: the same every round and on every
replica, with no state to keep.
"""

from __future__ import annotations

import hashlib
import sqlite3

from services.agent.protocol import ModelChoice, Promotion, PromotionStatus, ReaderChoice
from services.agent.turns import TurnStore
from services.common.errors import Conflict, InvalidRequest
from services.common.model_restrictions import ModelRestrictions
from services.common.readers import reader_name

PENDING: tuple[PromotionStatus, ...] = ("training", "evaluating")


def _unit(text: str) -> float:
    """A stable number in [0, 1) for ``text``."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def held_out(message_id: str, share: float) -> bool:
    return share > 0 and _unit(f"holdout:{message_id}") < share


# -- the tenant's chat model ----------------------------------------------------------------------


def chat_model(choice: ModelChoice, message_id: str) -> str | None:
    """The model a chat turn answers with when neither the turn nor its conversation names one:
    the canary for its share of turns, otherwise the tenant's default (None: the base model)."""
    if choice.canary and _unit(f"canary:{message_id}") < choice.canary_share:
        return choice.canary
    return choice.default


def promoted(choice: ModelChoice, model: str, share: float | None, now: float) -> ModelChoice:
    """``choice`` after promoting ``model``: as the default (``share`` None or 1), as a canary
    answering ``share`` of the chats, or, with 0, without the canary."""
    if share is not None and not 0.0 <= share <= 1.0:
        raise InvalidRequest(f"canary_share: {share} is outside 0 to 1", param="canary_share")
    out = choice.model_copy(deep=True)
    out.updated_at = now
    if share is not None and share < 1.0:
        if share == 0.0:
            if out.canary == model:
                out.canary, out.canary_share, out.canary_since = None, 0.0, None
            return out
        if out.default == model:
            raise Conflict(
                f"{model!r} is already the default for chat: a canary is for a candidate", param="model"
            )
        if out.canary != model:
            out.canary_since = now
        out.canary, out.canary_share = model, share
        return out
    if out.default != model:
        out.previous.append(out.default or "")
        out.default = model
    if out.canary == model:
        out.canary, out.canary_share, out.canary_since = None, 0.0, None
    return out


def reader_promoted(
    choice: ModelChoice, reader: ReaderChoice, share: float | None, now: float
) -> ModelChoice:
    """``choice`` with ``reader`` as the tenant's reader (the one before it kept for rollback)."""
    if share is not None and share != 1.0:
        # a canary compares what people say of answers per model; a reader's answers are not told apart
        raise InvalidRequest(
            f"canary_share: a reader has no canary ({reader.name!r}); promote it whole", param="canary_share"
        )
    out = choice.model_copy(deep=True)
    out.updated_at = now
    if out.reader is None or out.reader.name != reader.name:
        out.previous_readers.append(out.reader or ReaderChoice(name=""))
    out.reader = reader
    return out


def reader_rolled_back(choice: ModelChoice, name: str, now: float) -> ModelChoice:
    """``choice`` with the reader before ``name`` (the agent's reader setting at the start)."""
    if choice.reader is None or choice.reader.name != name:
        current = choice.reader.name if choice.reader else "the agent's reader setting"
        raise Conflict(
            f"{name!r} is not the tenant's reader ({current}): there is nothing to roll back", param="model"
        )
    out = choice.model_copy(deep=True)
    out.updated_at = now
    before = out.previous_readers.pop() if out.previous_readers else None
    out.reader = before if before is not None and before.name else None
    return out


def rolled_back(choice: ModelChoice, model: str, now: float) -> ModelChoice:
    """``choice`` without ``model``: a canary stops; a default gives way to the one before it."""
    out = choice.model_copy(deep=True)
    out.updated_at = now
    if out.canary == model:
        out.canary, out.canary_share, out.canary_since = None, 0.0, None
        return out
    if out.default == model:
        out.default = (out.previous.pop() if out.previous else "") or None
        return out
    raise Conflict(
        f"{model!r} is neither the tenant's default for chat ({choice.default or 'the base model'}) "
        "nor its canary: there is nothing to roll back",
        param="model",
    )


# -- the store ----------------------------------------------------------------------------------


class PromotionStore:
    """ModelChoice and Promotion records, in the turn store's database (their tables are in its
    schema), so they are as durable as the feedback they come from."""

    def __init__(self, turns: TurnStore, restrictions: ModelRestrictions) -> None:
        self.turns = turns
        # The collections each fine-tune was trained on, and whether an admin allowed it, kept
        # where the inference service reads them too (services/common/model_restrictions.py).
        self.restrictions = restrictions

    async def choice(self, tenant: str) -> ModelChoice:
        def fn(db: sqlite3.Connection) -> ModelChoice:
            row = db.execute("SELECT data FROM model_choice WHERE tenant = ?", (tenant,)).fetchone()
            return ModelChoice.model_validate_json(row[0]) if row else ModelChoice()

        return await self.turns.read(fn)

    async def save_choice(self, tenant: str, choice: ModelChoice) -> None:
        def fn(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO model_choice (tenant, data) VALUES (?, ?)"
                " ON CONFLICT (tenant) DO UPDATE SET data = excluded.data",
                (tenant, choice.model_dump_json()),
            )

        await self.turns.transact(fn)

    async def save(self, tenant: str, p: Promotion) -> None:
        def fn(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO promotions (job_id, tenant, status, created_at, data) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (job_id) DO UPDATE SET status = excluded.status, data = excluded.data",
                (p.job_id, tenant, p.status, p.created_at, p.model_dump_json()),
            )

        await self.turns.transact(fn)
        await self.restrict(tenant, p)

    async def restrict(self, tenant: str, p: Promotion) -> None:
        """Records what ``p``'s model was trained on, under each name it is served by: its job's
        (``ft-<x>``, ``ft-reader-<x>`` for a reader) and the published candidate's."""
        names = [reader_name(p.job_id) if p.kind == "reader" else f"ft-{p.job_id.removeprefix('ftjob-')}"]
        await self.restrictions.put(tenant, [*names, p.candidate or ""], p.collections, p.allowed is not None)

    async def restrict_all(self) -> None:
        """Records every tenant's fine-tunes from feedback (at start: the records kept before)."""

        def fn(db: sqlite3.Connection) -> list[tuple[str, Promotion]]:
            rows = db.execute("SELECT tenant, data FROM promotions ORDER BY created_at").fetchall()
            return [(r[0], Promotion.model_validate_json(r[1])) for r in rows]

        for tenant, p in await self.turns.read(fn):
            if p.collections:
                await self.restrict(tenant, p)

    async def recent(self, tenant: str, limit: int = 20) -> list[Promotion]:
        def fn(db: sqlite3.Connection) -> list[Promotion]:
            rows = db.execute(
                "SELECT data FROM promotions WHERE tenant = ? ORDER BY created_at DESC LIMIT ?",
                (tenant, limit),
            ).fetchall()
            return [Promotion.model_validate_json(r[0]) for r in rows]

        return await self.turns.read(fn)

    async def trained_as(self, tenant: str, model: str) -> Promotion | None:
        """The record of the job from the tenant's feedback that made ``model``, if one did: by
        the candidate it published, or, before the gate has seen it, by its job (the trainer
        publishes job ``ftjob-<x>`` as ``ft-<x>``)."""
        job_id = f"ftjob-{model.removeprefix('ft-')}"

        def fn(db: sqlite3.Connection) -> Promotion | None:
            row = db.execute(
                "SELECT data FROM promotions WHERE tenant = ? AND (job_id = ? OR json_extract(data, "
                "'$.candidate') = ?) ORDER BY created_at DESC LIMIT 1",
                (tenant, job_id, model),
            ).fetchone()
            return Promotion.model_validate_json(row[0]) if row else None

        return await self.turns.read(fn)

    async def pending(self) -> list[tuple[str, Promotion]]:
        def fn(db: sqlite3.Connection) -> list[tuple[str, Promotion]]:
            marks = ", ".join("?" for _ in PENDING)
            rows = db.execute(
                f"SELECT tenant, data FROM promotions WHERE status IN ({marks}) ORDER BY created_at", PENDING
            ).fetchall()
            return [(r[0], Promotion.model_validate_json(r[1])) for r in rows]

        return await self.turns.read(fn)
