"""Durable turn records, feedback and preference pairs, per tenant (issue 13).

A turn record is what the model saw and said: the exact prompt messages after
retrieval and prompt assembly, the model, the sampling parameters, the chunk
ids, the completion and its citations. Feedback and preference pairs point at
records. They are training data, so they live outside the conversation memory
(whose Redis keys expire and are capped) in a store of their own that survives
restarts of the agent and of Redis; a record is deleted only with its
conversation, when the tenant deletes it.

A record belongs to the one who asked (``turns.user``: the principal's ``owner``, the key id).
A tenant's member sees only its own records; an admin all of the tenant's (``owner_scope``).
Feedback and choices record who gave them (``key_id``; older rows: the record's owner, the
only one who could give them then), so a training set can cap and leave out rows per key.

``TurnStore`` is the protocol the routes use; ``SqliteTurnStore`` is the one
backend (see docs/agent.md for why SQLite): one file under
``$TANDEM_HOME/agent/``, WAL journal with ``synchronous=FULL`` so a committed
write survives a crash or power loss, calls run off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypedDict, TypeVar

from services.agent.protocol import TurnRecord
from services.common.auth import Principal
from services.common.errors import InvalidRequest

T = TypeVar("T")


def new_message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


def owner_scope(principal: Principal) -> str | None:
    """The owner whose records ``principal`` may see: None (all of the tenant's) for an admin."""
    return None if principal.is_admin else principal.owner


@dataclass
class FeedbackRow:
    message_id: str
    rating: int
    correction: str | None
    comment: str | None
    created_at: float
    updated_at: float
    key_id: str = ""  # who gave it


@dataclass
class FeedbackFilter:
    since: float | None = None
    pipeline: str | None = None
    model: str | None = None
    rating: int | None = None
    owner: str | None = None  # only records this owner asked for
    exclude_keys: frozenset[str] = frozenset()  # leave out what these keys gave


@dataclass
class PreferenceRow:
    chosen: TurnRecord
    rejected: TurnRecord
    created_at: float
    key_id: str = ""  # who chose


class ContributorRow(TypedDict):
    """One key's feedback in a tenant (``GET /v1/feedback/contributors``)."""

    key_id: str
    ratings: int
    corrections: int
    preferences: int
    last_at: float


class ModelFeedbackRow(TypedDict):
    """The feedback on one model's answers (``GET /v1/feedback/stats``)."""

    model: str
    up: int
    down: int
    corrections: int
    preferences: int


class QualityRow(TypedDict):
    """One model's answers in one time bucket (``GET /v1/quality``)."""

    model: str
    start: float
    answers: int
    groundedness_mean: float | None
    judged: int
    cited_share: float
    extractive_share: float
    not_found_share: float
    rated: int
    thumbs_up_rate: float | None


class TurnStore(Protocol):
    async def add_turn(self, tenant: str, user: str, record: TurnRecord) -> None: ...

    async def get_turn(self, tenant: str, message_id: str, owner: str | None = None) -> TurnRecord | None: ...

    async def delete_conversation(self, tenant: str, user: str, conversation_id: str) -> int: ...

    async def set_feedback(
        self,
        tenant: str,
        message_id: str,
        rating: int,
        correction: str | None,
        comment: str | None,
        key_id: str = "",
    ) -> FeedbackRow: ...

    async def list_feedback(
        self, tenant: str, filt: FeedbackFilter, limit: int | None = None, offset: int = 0
    ) -> tuple[list[tuple[FeedbackRow, TurnRecord]], int]: ...

    async def delete_feedback(self, tenant: str, message_id: str, owner: str | None = None) -> bool: ...

    async def feedback_of(self, tenant: str, message_ids: list[str]) -> dict[str, FeedbackRow]: ...

    async def add_preference(self, tenant: str, chosen: str, rejected: str, key_id: str = "") -> None: ...

    async def preferences(self, tenant: str, filt: FeedbackFilter) -> list[PreferenceRow]: ...

    async def given_before(self, tenant: str, key_id: str, at: float) -> int: ...

    async def contributors(self, tenant: str) -> list[ContributorRow]: ...

    async def stats(self, tenant: str, owner: str | None = None) -> list[ModelFeedbackRow]: ...

    async def quality_series(
        self, tenant: str, since: float, bucket_s: int, model: str | None = None
    ) -> list[QualityRow]: ...

    async def worst_answers(
        self, tenant: str, since: float, limit: int, model: str | None = None, owner: str | None = None
    ) -> list[tuple[TurnRecord, int | None]]: ...

    async def recent_chat_turns(self, tenant: str, limit: int, exclude: set[str]) -> list[TurnRecord]: ...

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

    async def transact(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

    def close(self) -> None: ...


SCHEMA = """
CREATE TABLE IF NOT EXISTS turns (
    message_id      TEXT PRIMARY KEY,
    tenant          TEXT NOT NULL,
    user            TEXT NOT NULL,
    conversation_id TEXT,
    pipeline        TEXT NOT NULL,
    model           TEXT NOT NULL,
    created_at      REAL NOT NULL,
    draft_of        TEXT,
    data            TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS turns_conv ON turns (tenant, conversation_id);
CREATE INDEX IF NOT EXISTS turns_owner ON turns (tenant, user);
CREATE TABLE IF NOT EXISTS feedback (
    message_id  TEXT PRIMARY KEY REFERENCES turns (message_id) ON DELETE CASCADE,
    tenant      TEXT NOT NULL,
    rating      INTEGER NOT NULL,
    correction  TEXT,
    comment     TEXT,
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL,
    key_id      TEXT
);
CREATE INDEX IF NOT EXISTS feedback_tenant ON feedback (tenant, updated_at);
CREATE TABLE IF NOT EXISTS quality (
    message_id   TEXT PRIMARY KEY REFERENCES turns (message_id) ON DELETE CASCADE,
    tenant       TEXT NOT NULL,
    pipeline     TEXT NOT NULL,
    model        TEXT NOT NULL,
    created_at   REAL NOT NULL,
    answer_kind  TEXT NOT NULL,
    cited        INTEGER NOT NULL,
    groundedness REAL
);
CREATE INDEX IF NOT EXISTS quality_tenant ON quality (tenant, created_at);
-- The model each tenant's chat answers with, and the fine-tunes the promotion gate judged
-- (services/agent/model_choice.py): JSON of ModelChoice and Promotion.
CREATE TABLE IF NOT EXISTS model_choice (
    tenant  TEXT PRIMARY KEY,
    data    TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS promotions (
    job_id      TEXT PRIMARY KEY,
    tenant      TEXT NOT NULL,
    status      TEXT NOT NULL,
    created_at  REAL NOT NULL,
    data        TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS promotions_tenant ON promotions (tenant, created_at);
CREATE TABLE IF NOT EXISTS preferences (
    tenant      TEXT NOT NULL,
    chosen      TEXT NOT NULL REFERENCES turns (message_id) ON DELETE CASCADE,
    rejected    TEXT NOT NULL REFERENCES turns (message_id) ON DELETE CASCADE,
    created_at  REAL NOT NULL,
    key_id      TEXT,
    PRIMARY KEY (tenant, chosen, rejected)
);
"""
# Columns added after the first release: (table, column, type), added to older files on open.
ADDED_COLUMNS = (("feedback", "key_id", "TEXT"), ("preferences", "key_id", "TEXT"))
# Who gave a feedback row (``f``, joined to its turn ``t``): rows from before ``key_id`` existed
# were given by the record's owner, the only key that could see it then.
FB_GIVER = "COALESCE(f.key_id, t.user)"
PREF_GIVER = "COALESCE(p.key_id, c.user)"  # who chose (``p``, its chosen turn ``c``)
FB_COLUMNS = f"f.message_id, f.rating, f.correction, f.comment, f.created_at, f.updated_at, {FB_GIVER}"


SQLITE_MAX_INT = 2**63 - 1
# The epoch was a Thursday: weekly buckets are shifted to start on Mondays (UTC).
WEEK_S = 7 * 86400
MONDAY_OFFSET_S = 4 * 86400


def _record(row: sqlite3.Row | tuple[Any, ...], offset: int = 0) -> TurnRecord:
    """A TurnRecord from the ``tenant, user, data`` columns starting at ``offset``."""
    rec = TurnRecord.model_validate_json(row[offset + 2])
    rec.tenant, rec.user = row[offset], row[offset + 1]
    return rec


def _set_rating(db: sqlite3.Connection, tenant: str, message_id: str, rating: int | None) -> None:
    """The rating on the record's ``quality`` (records without one, e.g. searches, stay as they are)."""
    db.execute(
        "UPDATE turns SET data = json_set(data, '$.quality.rating', ?)"
        " WHERE message_id = ? AND tenant = ? AND json_type(data, '$.quality') = 'object'",
        (rating, message_id, tenant),
    )


def _filter_sql(
    tenant: str, filt: FeedbackFilter, *, tenant_col: str, since_col: str, turn: str, giver: str
) -> tuple[list[str], list[Any]]:
    """WHERE terms and their arguments for the tenant and a filter's since/pipeline/model/owner
    and left-out keys (``turn`` is the alias of the joined turns table, ``giver`` the expression
    of who gave the row)."""
    where = [f"{tenant_col} = ?"]
    args: list[Any] = [tenant]
    if filt.owner is not None:
        where.append(f"{turn}.user = ?")
        args.append(filt.owner)
    if filt.exclude_keys:
        where.append(f"{giver} NOT IN ({','.join('?' * len(filt.exclude_keys))})")
        args.extend(sorted(filt.exclude_keys))
    if filt.since is not None:
        where.append(f"{since_col} >= ?")
        args.append(filt.since)
    if filt.pipeline:
        where.append(f"{turn}.pipeline = ?")
        args.append(filt.pipeline)
    if filt.model:
        where.append(f"{turn}.model = ?")
        args.append(filt.model)
    return where, args


class SqliteTurnStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        # One connection, used from worker threads one call at a time (the lock): SQLite
        # serialises writers anyway, and these calls are small.
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is on disk (WAL fsynced) before it returns, so an acknowledged
        # record or rating survives a power loss, not only a process crash.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(SCHEMA)
        for table, column, kind in ADDED_COLUMNS:
            if column not in {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn``'s reads, without taking SQLite's write lock (``transact`` does): a chat turn
        reads its tenant's model choice on the hot path beside the record writes."""

        def call() -> T:
            with self._lock:
                return fn(self._db)

        return await asyncio.to_thread(call)

    async def transact(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            with self._lock:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    out = fn(self._db)
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
                return out

        return await asyncio.to_thread(call)

    # -- turns ------------------------------------------------------------------------------

    async def add_turn(self, tenant: str, user: str, record: TurnRecord) -> None:
        data = record.model_dump_json(exclude={"tenant", "user"}, round_trip=True)
        # ``sources`` is excluded from the public dump; keep it in the stored one.
        stored = json.loads(data)
        stored["sources"] = record.sources
        blob = json.dumps(stored)

        def fn(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO turns (message_id, tenant, user, conversation_id, pipeline, model, created_at,"
                " draft_of, data) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.message_id,
                    tenant,
                    user,
                    record.conversation_id,
                    record.pipeline,
                    record.model,
                    record.created_at,
                    record.draft_of,
                    blob,
                ),
            )
            q = record.quality
            if q is not None:
                # The columns the quality report groups and sorts by; the record's JSON keeps the rest.
                db.execute(
                    "INSERT INTO quality (message_id, tenant, pipeline, model, created_at, answer_kind, cited,"
                    " groundedness) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        record.message_id,
                        tenant,
                        record.pipeline,
                        q.model,
                        record.created_at,
                        q.answer_kind,
                        int(q.cited),
                        q.groundedness,
                    ),
                )

        await self.transact(fn)

    async def get_turn(self, tenant: str, message_id: str, owner: str | None = None) -> TurnRecord | None:
        """The tenant's record; with ``owner``, only if that owner asked for it."""

        def fn(db: sqlite3.Connection) -> TurnRecord | None:
            row = db.execute(
                "SELECT tenant, user, data FROM turns WHERE message_id = ? AND tenant = ?"
                " AND (? IS NULL OR user = ?)",
                (message_id, tenant, owner, owner),
            ).fetchone()
            return _record(row) if row else None

        return await self.transact(fn)

    async def delete_conversation(self, tenant: str, user: str, conversation_id: str) -> int:
        def fn(db: sqlite3.Connection) -> int:
            # Feedback and preference rows go with their turns (ON DELETE CASCADE).
            cur = db.execute(
                "DELETE FROM turns WHERE tenant = ? AND user = ? AND conversation_id = ?",
                (tenant, user, conversation_id),
            )
            return int(cur.rowcount)

        return await self.transact(fn)

    # -- feedback ---------------------------------------------------------------------------

    async def set_feedback(
        self,
        tenant: str,
        message_id: str,
        rating: int,
        correction: str | None,
        comment: str | None,
        key_id: str = "",
    ) -> FeedbackRow:
        """Records or replaces the feedback on a message; ``key_id`` gave it (the last to change
        it is who it counts for)."""
        now = time.time()

        def fn(db: sqlite3.Connection) -> FeedbackRow:
            db.execute(
                "INSERT INTO feedback (message_id, tenant, rating, correction, comment, created_at, updated_at,"
                " key_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (message_id) DO UPDATE SET"
                " rating = excluded.rating, correction = excluded.correction, comment = excluded.comment,"
                " updated_at = excluded.updated_at, key_id = excluded.key_id",
                (message_id, tenant, rating, correction, comment, now, now, key_id or None),
            )
            _set_rating(db, tenant, message_id, rating)
            row = db.execute(
                f"SELECT {FB_COLUMNS} FROM feedback f JOIN turns t ON t.message_id = f.message_id"
                " WHERE f.message_id = ?",
                (message_id,),
            ).fetchone()
            return FeedbackRow(*row)

        return await self.transact(fn)

    async def list_feedback(
        self, tenant: str, filt: FeedbackFilter, limit: int | None = None, offset: int = 0
    ) -> tuple[list[tuple[FeedbackRow, TurnRecord]], int]:
        if offset > SQLITE_MAX_INT:
            # SQLite's integers are 64-bit: a larger one would not bind (OverflowError, a 500).
            raise InvalidRequest(f"offset: at most {SQLITE_MAX_INT} (got {offset})", param="offset")
        where, args = _filter_sql(
            tenant, filt, tenant_col="f.tenant", since_col="f.updated_at", turn="t", giver=FB_GIVER
        )
        if filt.rating is not None:
            where.append("f.rating = ?")
            args.append(filt.rating)
        clause = " AND ".join(where)

        def fn(db: sqlite3.Connection) -> tuple[list[tuple[FeedbackRow, TurnRecord]], int]:
            total = db.execute(
                f"SELECT COUNT(*) FROM feedback f JOIN turns t ON t.message_id = f.message_id WHERE {clause}",
                args,
            ).fetchone()[0]
            rows = db.execute(
                f"SELECT {FB_COLUMNS}, t.tenant, t.user, t.data FROM feedback f"
                " JOIN turns t ON t.message_id = f.message_id"
                f" WHERE {clause} ORDER BY f.updated_at DESC, f.message_id LIMIT ? OFFSET ?",
                [*args, -1 if limit is None else limit, offset],
            ).fetchall()
            return [(FeedbackRow(*r[:7]), _record(r, 7)) for r in rows], int(total)

        return await self.transact(fn)

    async def feedback_of(self, tenant: str, message_ids: list[str]) -> dict[str, FeedbackRow]:
        """The tenant's feedback on these messages (for showing a reopened conversation's thumbs)."""
        if not message_ids:
            return {}

        def fn(db: sqlite3.Connection) -> dict[str, FeedbackRow]:
            marks = ",".join("?" * len(message_ids))
            rows = db.execute(
                f"SELECT {FB_COLUMNS} FROM feedback f JOIN turns t ON t.message_id = f.message_id"
                f" WHERE f.tenant = ? AND f.message_id IN ({marks})",
                [tenant, *message_ids],
            ).fetchall()
            return {r[0]: FeedbackRow(*r) for r in rows}

        return await self.transact(fn)

    async def delete_feedback(self, tenant: str, message_id: str, owner: str | None = None) -> bool:
        """With ``owner``: only feedback on a record that owner asked for."""

        def fn(db: sqlite3.Connection) -> bool:
            cur = db.execute(
                "DELETE FROM feedback WHERE tenant = ? AND message_id = ? AND (? IS NULL OR message_id IN"
                " (SELECT message_id FROM turns WHERE message_id = ? AND user = ?))",
                (tenant, message_id, owner, message_id, owner),
            )
            if not cur.rowcount:
                return False
            _set_rating(db, tenant, message_id, None)
            return True

        return await self.transact(fn)

    # -- preference pairs -------------------------------------------------------------------

    async def add_preference(self, tenant: str, chosen: str, rejected: str, key_id: str = "") -> None:
        def fn(db: sqlite3.Connection) -> None:
            # Choosing again between the same two drafts replaces the earlier choice.
            db.execute(
                "DELETE FROM preferences WHERE tenant = ? AND ((chosen = ? AND rejected = ?)"
                " OR (chosen = ? AND rejected = ?))",
                (tenant, chosen, rejected, rejected, chosen),
            )
            db.execute(
                "INSERT INTO preferences (tenant, chosen, rejected, created_at, key_id) VALUES (?, ?, ?, ?, ?)",
                (tenant, chosen, rejected, time.time(), key_id or None),
            )

        await self.transact(fn)

    async def preferences(self, tenant: str, filt: FeedbackFilter) -> list[PreferenceRow]:
        where, args = _filter_sql(
            tenant, filt, tenant_col="p.tenant", since_col="p.created_at", turn="c", giver=PREF_GIVER
        )

        def fn(db: sqlite3.Connection) -> list[PreferenceRow]:
            rows = db.execute(
                "SELECT c.tenant, c.user, c.data, r.tenant, r.user, r.data, p.created_at,"
                f" {PREF_GIVER} FROM preferences p"
                " JOIN turns c ON c.message_id = p.chosen JOIN turns r ON r.message_id = p.rejected"
                f" WHERE {' AND '.join(where)} ORDER BY p.created_at",
                args,
            ).fetchall()
            return [PreferenceRow(_record(r, 0), _record(r, 3), float(r[6]), str(r[7])) for r in rows]

        return await self.transact(fn)

    async def given_before(self, tenant: str, key_id: str, at: float) -> int:
        """Ratings and choices ``key_id`` gave before ``at`` (what a per-key cap counts first)."""

        def fn(db: sqlite3.Connection) -> int:
            ratings = db.execute(
                f"SELECT COUNT(*) FROM feedback f JOIN turns t ON t.message_id = f.message_id"
                f" WHERE f.tenant = ? AND {FB_GIVER} = ? AND f.created_at < ?",
                (tenant, key_id, at),
            ).fetchone()[0]
            choices = db.execute(
                "SELECT COUNT(*) FROM preferences p JOIN turns c ON c.message_id = p.chosen"
                f" WHERE p.tenant = ? AND {PREF_GIVER} = ? AND p.created_at < ?",
                (tenant, key_id, at),
            ).fetchone()[0]
            return int(ratings) + int(choices)

        return await self.read(fn)

    async def contributors(self, tenant: str) -> list[ContributorRow]:
        """Per key that gave feedback: its ratings, corrections and choices, and when it last gave one."""

        def fn(db: sqlite3.Connection) -> list[ContributorRow]:
            out: dict[str, ContributorRow] = {}

            def entry(key_id: str) -> ContributorRow:
                return out.setdefault(
                    key_id,
                    {"key_id": key_id, "ratings": 0, "corrections": 0, "preferences": 0, "last_at": 0.0},
                )

            for key_id, n, corrections, last in db.execute(
                f"SELECT {FB_GIVER}, COUNT(*), SUM(f.correction IS NOT NULL AND f.correction != ''),"
                " MAX(f.updated_at) FROM feedback f JOIN turns t ON t.message_id = f.message_id"
                f" WHERE f.tenant = ? GROUP BY {FB_GIVER}",
                (tenant,),
            ):
                e = entry(str(key_id))
                e["ratings"], e["corrections"], e["last_at"] = int(n), int(corrections or 0), float(last)
            for key_id, n, last in db.execute(
                f"SELECT {PREF_GIVER}, COUNT(*), MAX(p.created_at) FROM preferences p"
                f" JOIN turns c ON c.message_id = p.chosen WHERE p.tenant = ? GROUP BY {PREF_GIVER}",
                (tenant,),
            ):
                e = entry(str(key_id))
                e["preferences"] = int(n)
                e["last_at"] = max(e["last_at"], float(last))
            return sorted(out.values(), key=lambda e: (-e["last_at"], e["key_id"]))

        return await self.read(fn)

    async def stats(self, tenant: str, owner: str | None = None) -> list[ModelFeedbackRow]:
        def fn(db: sqlite3.Connection) -> list[ModelFeedbackRow]:
            out: dict[str, ModelFeedbackRow] = {}

            def entry(model: str) -> ModelFeedbackRow:
                return out.setdefault(
                    model, {"model": model, "up": 0, "down": 0, "corrections": 0, "preferences": 0}
                )

            for model, up, down, corrections in db.execute(
                "SELECT t.model, SUM(f.rating = 1), SUM(f.rating = -1),"
                " SUM(f.correction IS NOT NULL AND f.correction != '')"
                " FROM feedback f JOIN turns t ON t.message_id = f.message_id WHERE f.tenant = ?"
                " AND (? IS NULL OR t.user = ?) GROUP BY t.model",
                (tenant, owner, owner),
            ):
                e = entry(model)
                e["up"], e["down"], e["corrections"] = int(up or 0), int(down or 0), int(corrections or 0)
            for model, n in db.execute(
                "SELECT t.model, COUNT(*) FROM preferences p JOIN turns t ON t.message_id = p.chosen"
                " WHERE p.tenant = ? AND (? IS NULL OR t.user = ?) GROUP BY t.model",
                (tenant, owner, owner),
            ):
                entry(model)["preferences"] = int(n)
            return sorted(out.values(), key=lambda e: e["model"])

        return await self.transact(fn)

    # -- answer quality ---------------------------------------------------------------------

    async def quality_series(
        self, tenant: str, since: float, bucket_s: int, model: str | None = None
    ) -> list[QualityRow]:
        """Per model and time bucket: answers, groundedness, citing and kinds, and thumbs."""
        offset = MONDAY_OFFSET_S if bucket_s == WEEK_S else 0
        where = "q.tenant = ? AND q.created_at >= ?"
        args: list[Any] = [offset, bucket_s, bucket_s, offset, tenant, since]
        if model is not None:
            where += " AND q.model = ?"
            args.append(model)

        def fn(db: sqlite3.Connection) -> list[QualityRow]:
            rows = db.execute(
                # CAST truncates, which is floor for the (positive) times since the offset.
                "SELECT q.model, CAST((q.created_at - ?) / ? AS INTEGER) * ? + ? AS start, COUNT(*),"
                " AVG(q.groundedness), COUNT(q.groundedness), SUM(q.cited),"
                " SUM(q.answer_kind = 'extractive'), SUM(q.answer_kind = 'not_found'),"
                " COUNT(f.rating), SUM(f.rating = 1)"
                " FROM quality q LEFT JOIN feedback f ON f.message_id = q.message_id"
                f" WHERE {where} GROUP BY q.model, start ORDER BY q.model, start",
                args,
            ).fetchall()
            out: list[QualityRow] = []
            for m, start, n, mean, judged, cited, extractive, not_found, rated, up in rows:
                out.append(
                    {
                        "model": m,
                        "start": float(start),
                        "answers": int(n),
                        "groundedness_mean": None if mean is None else float(mean),
                        "judged": int(judged),
                        "cited_share": int(cited or 0) / n,
                        "extractive_share": int(extractive or 0) / n,
                        "not_found_share": int(not_found or 0) / n,
                        "rated": int(rated),
                        "thumbs_up_rate": int(up or 0) / rated if rated else None,
                    }
                )
            return out

        return await self.transact(fn)

    async def worst_answers(
        self, tenant: str, since: float, limit: int, model: str | None = None, owner: str | None = None
    ) -> list[tuple[TurnRecord, int | None]]:
        """The tenant's answers since ``since`` with a thumbs down or not wholly supported: thumbs
        down first, then by groundedness (lowest first), then the newest; each with its rating.
        With ``owner``: only the answers that owner asked for."""
        where = "q.tenant = ? AND q.created_at >= ? AND (f.rating = -1 OR q.groundedness < 1.0)"
        args: list[Any] = [tenant, since]
        if model is not None:
            where += " AND q.model = ?"
            args.append(model)
        if owner is not None:
            where += " AND t.user = ?"
            args.append(owner)

        def fn(db: sqlite3.Connection) -> list[tuple[TurnRecord, int | None]]:
            rows = db.execute(
                "SELECT t.tenant, t.user, t.data, f.rating FROM quality q"
                " JOIN turns t ON t.message_id = q.message_id"
                " LEFT JOIN feedback f ON f.message_id = q.message_id"
                f" WHERE {where} ORDER BY (f.rating = -1) DESC, q.groundedness IS NULL,"
                " q.groundedness, q.created_at DESC, q.message_id LIMIT ?",
                [*args, limit],
            ).fetchall()
            return [(_record(r), None if r[3] is None else int(r[3])) for r in rows]

        return await self.transact(fn)

    async def recent_chat_turns(self, tenant: str, limit: int, exclude: set[str]) -> list[TurnRecord]:
        """The tenant's newest chat answers (pipeline turns with quality signals, drafts left out),
        one per question, not in ``exclude`` (message ids)."""

        def fn(db: sqlite3.Connection) -> list[TurnRecord]:
            rows = db.execute(
                "SELECT t.tenant, t.user, t.data FROM quality q JOIN turns t ON t.message_id = q.message_id"
                " WHERE q.tenant = ? AND t.draft_of IS NULL ORDER BY q.created_at DESC, q.message_id",
                (tenant,),
            )
            out: list[TurnRecord] = []
            seen: set[str] = set()
            for row in rows:
                rec = _record(row)
                question = rec.question.strip().lower()
                if rec.message_id in exclude or not question or question in seen or rec.kind != "pipeline":
                    continue
                seen.add(question)
                out.append(rec)
                if len(out) >= limit:
                    break
            return out

        return await self.transact(fn)
